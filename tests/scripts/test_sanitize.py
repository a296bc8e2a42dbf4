#!/usr/bin/env python3
"""scripts/sanitize.sh and sanitize_summary.py on the CPU: compute-sanitizer's records (in the formats
its manual shows) given to replay or a library, and the script run end to end with a stand-in
sanitizer and stand-in binaries: one log per run, the summary, and the exit status (1 for a finding
in replay's kernels, 2 for a run that did not complete, 0 when clean)."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import sanitize_summary as ss  # noqa: E402

MEMCHECK = """\
# the program's own output
step 0 loss 5.1
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at replay::(anonymous namespace)::layernorm_kernel(float *, int)+0x90
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x87654320 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: replay::layernorm(...) [0xadb6] in replay-gpt3
=========
========= Invalid __global__ read of size 16 bytes
=========     at sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64+0x1f0
=========     by thread (3,0,0) in block (7,0,0)
=========     Address 0x7f0000001000 is out of bounds
=========
========= Invalid __global__ read of size 16 bytes
=========     at sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64+0x1f0
=========     by thread (4,0,0) in block (7,0,0)
=========     Address 0x7f0000001010 is out of bounds
=========
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaFuncSetAttribute.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: cudaFuncSetAttribute [0x1234] in libcudnn_engines_precompiled.so.9
=========         Host Frame: cudnn::backend::execute [0x5678] in libcudnn_graph.so.9
=========         Host Frame: replay::attention_forward [0x9abc] in replay-gpt3
=========
========= Leaked 1,024 bytes at 0x7879c0800000
=========     Saved host backtrace up to driver entry point at allocation time
=========         Host Frame: cudaMalloc [0x56624] in replay-gpt3
=========         Host Frame: replay::Arena::Arena [0xae5c] in replay-gpt3
=========
========= LEAK SUMMARY: 1024 bytes leaked in 1 allocations
========= ERROR SUMMARY: 5 errors
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at void cutlass::Kernel2<cutlass_80_gemm>(Params)+0x90 in gemm.cu:41
=========     and Read access at void cutlass::Kernel2<cutlass_80_gemm>(Params)+0x100 in gemm.cu:51 [508 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
========= ERROR SUMMARY: 1 error
"""


class ParseTest(unittest.TestCase):
    def test_memcheck_records_go_to_replay_or_the_library(self):
        r = ss.parse_log(MEMCHECK)
        self.assertEqual(r["error_summary"], 5)
        ours = {(e["where"], e["count"]) for e in r["replay"]}
        self.assertIn(("replay::(anonymous namespace)::layernorm_kernel(float *, int)", 1), ours)
        self.assertIn(("cudaMalloc", 1), ours)  # the leak: allocated by replay's Arena
        lib = {(e["where"], e["count"], e["owner"]) for e in r["library"]}
        self.assertIn(("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 2, "library"), lib)
        self.assertIn(("cudaFuncSetAttribute", 1, "libcudnn_engines_precompiled.so.9"), lib)
        self.assertEqual(r["leak_summary"], "1024 bytes leaked in 1 allocations")
        kinds = {e["kind"] for e in r["replay"] + r["library"]}
        self.assertIn("Invalid __global__ read of size 16 bytes", kinds)

    def test_a_race_in_a_library_kernel_is_the_librarys(self):
        r = ss.parse_log(RACECHECK)
        self.assertEqual(r["replay"], [])
        self.assertEqual(len(r["library"]), 1)
        self.assertIn("cutlass::Kernel2", r["library"][0]["where"])
        self.assertTrue(r["library"][0]["kind"].startswith("Error: Race reported between Write access"))
        self.assertEqual(r["racecheck_summary"], "1 hazard displayed (1 error, 0 warnings)")

    def test_an_internal_sanitizer_error_is_the_tools_and_the_programs_error_is_kept(self):
        text = ("========= COMPUTE-SANITIZER\n"
                "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.\n"
                "========= \n"
                "replay-gpt3: region 'layer0.fwd': cuDNN frontend error CUDNN_BACKEND_API_FAILED\n"
                "========= Target application returned an error\n"
                "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
        r = ss.parse_log(text)
        self.assertEqual(r["replay"], [])
        self.assertEqual([(e["owner"], e["where"]) for e in r["library"]], [("sanitizer", "compute-sanitizer")])
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "racecheck_gpt3_none.log"), "w") as f:
                f.write(text)
            with open(os.path.join(tmp, "racecheck_gpt3_none.meta"), "w") as f:
                f.write("tool=racecheck\nworkload=gpt3\nmode=none\nrc=1\nseconds=6.0\n")
            run = ss.read_run(os.path.join(tmp, "racecheck_gpt3_none.log"))
            self.assertEqual(run["status"], "sanitizer failed")  # the tool's own error, not the program's
            self.assertTrue(run["program_error"].startswith("replay-gpt3: region 'layer0.fwd': cuDNN"))

    def test_racecheck_ends_with_its_own_summary(self):
        text = ("========= COMPUTE-SANITIZER\n[  PASSED  ] 2 tests.\n"
                "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
        r = ss.parse_log(text)
        self.assertEqual((r["error_summary"], r["replay"], r["library"]), (0, [], []))
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "racecheck_test_rng_gpu_test.log"), "w") as f:
                f.write(text)
            with open(os.path.join(tmp, "racecheck_test_rng_gpu_test.meta"), "w") as f:
                f.write("tool=racecheck\nworkload=test_rng_gpu\nmode=test\nrc=0\nseconds=8.0\n")
            self.assertEqual(ss.read_run(os.path.join(tmp, "racecheck_test_rng_gpu_test.log"))["status"], "complete")

    def test_a_clean_log_has_no_findings(self):
        r = ss.parse_log("========= COMPUTE-SANITIZER\nstep 0\n========= ERROR SUMMARY: 0 errors\n")
        self.assertEqual((r["error_summary"], r["replay"], r["library"]), (0, [], []))


FAKE_SANITIZER = """\
#!/usr/bin/env bash
# Stand-in compute-sanitizer: prints its arguments, runs the program, and for racecheck on gpt3 in
# layer mode reports a race in a replay kernel.
if [ "$1" = --version ]; then echo "fake sanitizer 1.0"; exit 0; fi
echo "========= COMPUTE-SANITIZER"
echo "ARGS $*"
tool=""; while [ $# -gt 0 ]; do case "$1" in --tool) tool=$2; shift 2 ;; --*) shift 2 ;; *) break ;; esac; done
case "$*" in --leak-check*) ;; esac
"$@"; rc=$?
if [ "$tool" = racecheck ] && [[ "$1" == *replay-gpt3 ]] && [[ "$*" == *"--graphs layer"* ]]; then
  echo "========= Error: Race reported between Write access at replay::softmax_kernel(float *)+0x90 in s.cu:4"
  echo "=========     and Read access at replay::softmax_kernel(float *)+0x100 in s.cu:5 [2 hazards]"
  echo "========= ERROR SUMMARY: 1 error"
elif [ $rc -ne 0 ]; then
  echo "========= Target application returned an error"
  echo "========= ERROR SUMMARY: 1 error"
else
  echo "========= ERROR SUMMARY: 0 errors"
fi
exit $rc
"""

FAKE_BINARY = """\
#!/usr/bin/env bash
echo "fake {name} $*"
case "$*" in *--skip-peak*) ;; *) echo "no --skip-peak"; exit 3 ;; esac
{fail}
exit 0
"""


class ScriptTest(unittest.TestCase):
    def run_script(self, tmp, fail_llama=False, tools="memcheck racecheck", workloads="gpt3 llama31", tests=None):
        bindir = os.path.join(tmp, "bin")
        os.makedirs(bindir, exist_ok=True)
        for name in ("gpt3", "llama31"):
            path = os.path.join(bindir, "replay-" + name)
            fail = 'case "$*" in *"--graphs full"*) exit 1 ;; esac' if fail_llama and name == "llama31" else ""
            with open(path, "w") as f:
                f.write(FAKE_BINARY.format(name=name, fail=fail))
            os.chmod(path, 0o755)
        san = os.path.join(tmp, "compute-sanitizer")
        with open(san, "w") as f:
            f.write(FAKE_SANITIZER)
        os.chmod(san, 0o755)
        out = os.path.join(tmp, "out")
        extra = []
        if tests:
            testdir = os.path.join(tmp, "tests")  # the default: the build's tests/ beside bin/
            os.makedirs(testdir, exist_ok=True)
            for name in (t.split(":")[0] for t in tests.split()):
                path = os.path.join(testdir, name)
                with open(path, "w") as f:
                    f.write(f'#!/usr/bin/env bash\necho "[  PASSED  ] {name} $*"\nexit 0\n')
                os.chmod(path, 0o755)
            extra = ["--tests", tests]
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "sanitize.sh"), "--out", out, "--bin", bindir,
                            "--sanitizer", san, "--tools", tools, "--workloads", workloads,
                            "--jobs", "4", "--timeout", "60", "--sanitizer-args", "--check-bulk-copy no", *extra],
                           capture_output=True, text=True, timeout=120)
        with open(os.path.join(out, "summary.json")) as f:
            return p, out, json.load(f)

    def test_one_log_per_run_and_a_race_in_replay_fails_the_script(self):
        with tempfile.TemporaryDirectory() as tmp:
            p, out, s = self.run_script(tmp)
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            self.assertEqual(len(s["runs"]), 2 * 2 * 3)
            for tool in ("memcheck", "racecheck"):
                for w in ("gpt3", "llama31"):
                    for m in ("none", "layer", "full"):
                        self.assertTrue(os.path.exists(os.path.join(out, f"{tool}_{w}_{m}.log")))
            with open(os.path.join(out, "memcheck_gpt3_full.log")) as f:
                log = f.read()
            self.assertIn("--leak-check full", log)
            self.assertIn("--kernel-name kns=6replay", log)
            self.assertIn("--check-bulk-copy no", log)  # --sanitizer-args reach every run
            self.assertIn("--graphs full", log)
            bad = [r for r in s["runs"] if r["replay"]]
            self.assertEqual([(r["tool"], r["workload"], r["mode"]) for r in bad], [("racecheck", "gpt3", "layer")])
            self.assertEqual(bad[0]["replay"][0]["where"], "replay::softmax_kernel(float *)")
            self.assertEqual(s["replay_findings"], 1)
            self.assertIn("racecheck | gpt3 | layer | complete", p.stdout)

    def test_a_failing_program_is_an_incomplete_run(self):
        with tempfile.TemporaryDirectory() as tmp:
            p, _, s = self.run_script(tmp, fail_llama=True, tools="memcheck")
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertEqual(s["replay_findings"], 0)
            self.assertEqual(s["incomplete"], ["memcheck_llama31_full.log"])
            run = [r for r in s["runs"] if r["log"] == "memcheck_llama31_full.log"][0]
            self.assertEqual((run["status"], run["exit_code"]), ("program failed", 1))

    def test_unit_tests_run_under_each_tool_with_the_filter(self):
        with tempfile.TemporaryDirectory() as tmp:
            p, out, s = self.run_script(tmp, tools="memcheck racecheck", workloads="",
                                        tests="test_pointwise_gpu test_group_norm_gpu")
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertEqual(sorted((r["tool"], r["workload"], r["mode"]) for r in s["runs"]),
                             [(t, x, "test") for t in ("memcheck", "racecheck")
                              for x in ("test_group_norm_gpu", "test_pointwise_gpu")])
            with open(os.path.join(out, "racecheck_test_pointwise_gpu_test.log")) as f:
                log = f.read()
            self.assertIn("--kernel-name kns=6replay", log)
            self.assertIn("[  PASSED  ] test_pointwise_gpu", log)
            self.assertNotIn("--preset", log)
            ports = set()
            for r in s["runs"]:
                with open(os.path.join(out, r["log"])) as f:
                    ports.add(f.read().split("--port ")[1].split()[0])
            self.assertEqual(len(ports), 4)  # each run its own port
        with tempfile.TemporaryDirectory() as tmp:  # NAME:FILTER: the binary with --gtest_filter
            p, out, s = self.run_script(tmp, tools="racecheck", workloads="",
                                        tests="test_group_norm_gpu:GroupNorm*Small*")
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertEqual([(r["workload"], r["mode"]) for r in s["runs"]],
                             [("test_group_norm_gpu-GroupNorm-Small-", "test")])
            with open(os.path.join(out, "racecheck_test_group_norm_gpu-GroupNorm-Small-_test.log")) as f:
                self.assertIn("[  PASSED  ] test_group_norm_gpu --gtest_filter=GroupNorm*Small*", f.read())
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "sanitize.sh"), "--bin", tmp,
                                "--sanitizer", "/bin/true", "--workloads", "", "--tests", "test_missing_gpu"],
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(p.returncode, 2)
            self.assertIn("test_missing_gpu not found", p.stderr)

    def test_bad_options_are_refused(self):
        for args, msg in ((["--tools", "helgrind"], "unknown tool 'helgrind'"),
                          (["--modes", "half"], "unknown mode 'half'"),
                          (["--bogus"], "unknown option '--bogus'")):
            p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "sanitize.sh")] + args,
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(p.returncode, 2)
            self.assertIn(msg, p.stderr)


if __name__ == "__main__":
    unittest.main()
