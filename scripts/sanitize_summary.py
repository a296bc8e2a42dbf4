#!/usr/bin/env python3
"""sanitize_summary.py: reads the logs scripts/sanitize.sh wrote (one per tool, workload and graph
mode: compute-sanitizer's report and the program's output) and writes summary.json and summary.md.

Every finding compute-sanitizer prints (a line "========= <what>" and its indented lines) is given to
replay or to a library:
- a kernel finding (memcheck's invalid accesses, initcheck's uninitialized reads, racecheck's
  hazards, synccheck's barrier errors) by the kernel's name: replay's kernels live in namespace
  replay ("replay::" in the demangled name, as the --kernel-name filter "kns=6replay" selects them);
  any other kernel (cuBLASLt, cuDNN, CUB, NCCL) is a library's;
- an API error or a leak by the host backtrace saved with it: the first frame that is not the CUDA
  runtime or driver entry point; a frame in libcudnn, libcublas, libnccl ... is the library's;
- an "Internal Sanitizer Error" (the tool failed, e.g. on a hardware exception) to "sanitizer".

A run is complete when compute-sanitizer printed its ERROR SUMMARY (racecheck: its RACECHECK SUMMARY)
and the program exited 0. Exit
status: 1 when any finding is replay's, else 2 when a run did not complete, else 0.

  scripts/sanitize_summary.py OUT_DIR
"""
import json
import os
import re
import sys

PREFIX = "========="
LIBRARIES = ("libcudnn", "libcublas", "libnccl", "libcufft", "libcurand", "libcusparse", "libcusolver",
             "libnvrtc", "libnvJitLink", "libnvblas")
NOT_FINDINGS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "LEAK SUMMARY", "RACECHECK SUMMARY",
                "Target application returned an error", "Error: process didn't terminate successfully")
RUNTIME_FRAME = re.compile(r"^(cuda[A-Z_]|cu[A-Z]|__cuda|_cuda|libcudart|cudart::)")


def records(text):
    """The compute-sanitizer records of a log: lists of lines, the header first, prefix removed."""
    out, cur = [], None
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(PREFIX):
            continue
        rest = line[len(PREFIX):]
        if not rest.strip():  # "=========" alone ends a record
            cur = None
            continue
        if rest.startswith(" ") and not rest.startswith("  "):  # a header
            cur = [rest.strip()]
            out.append(cur)
        elif cur is not None:
            cur.append(rest.strip())
    return out


def functions(rec):
    """Device functions a record names: "at f+0x..", "Device Frame: f+0x..", "Thread (x) at f+0x.."."""
    names = []
    for line in rec:
        if line.startswith("Host Frame"):
            continue
        for m in re.finditer(r"(?:\bat |Device Frame: ?)(.+?)(?:\+|:)0x[0-9a-fA-F]+", line):
            names.append(m.group(1).strip())
    return names


def host_frames(rec):
    """(function, module) of every "Host Frame: f [0x..] in module" line, innermost first."""
    frames = []
    for line in rec:
        m = re.match(r"Host Frame: ?(.*?) \[0x[0-9a-fA-F]+\] in (.*)$", line)
        if m:
            frames.append((m.group(1).strip(), os.path.basename(m.group(2).strip())))
    return frames


def kind_of(header):
    """The header without addresses, counts and sizes that differ between occurrences."""
    h = header
    h = re.sub(r"\bat \S.*?(?:\+|:)0x[0-9a-fA-F]+( in \S+)?", "", h)
    h = re.sub(r"0x[0-9a-fA-F]+", "0x..", h)
    h = re.sub(r"\(\d+,\d+,\d+\)", "(..)", h)
    h = re.sub(r"Leaked [\d,]+ bytes", "Leaked memory", h)
    h = re.sub(r"\s+", " ", h).strip(" :")
    return h


def owner_of_frames(frames):
    """'replay', or the library module that made the call, from a saved host backtrace."""
    for fn, module in frames:
        if module.startswith(LIBRARIES):
            return module
        if RUNTIME_FRAME.match(fn) or module.startswith(("libcuda.", "libcudart")):
            continue  # the runtime (linked into the binary) or the driver: look further out
        return "replay"
    return "replay" if frames else "unknown"


def classify(rec):
    """(owner, what, kind): owner 'replay', a library's name or 'sanitizer' (the tool's own failure,
    which names no kernel: the program's error, in the same log, says what failed); what the kernel
    or API call."""
    header = rec[0]
    kind = kind_of(header)
    if header.startswith("Internal Sanitizer Error"):
        return "library:sanitizer", "compute-sanitizer", kind
    names = functions(rec)
    if names:
        kernel = names[-1]  # the outermost device frame is the kernel itself
        owner = "replay" if any("replay::" in n or "6replay" in n for n in names) else "library"
        return owner, kernel, kind
    frames = host_frames(rec)
    m = re.search(r"API call to (\w+)", header)
    what = m.group(1) if m else (frames[0][0] if frames else "")
    owner = owner_of_frames(frames)
    if owner not in ("replay", "unknown"):
        owner = "library:" + owner
    elif owner == "unknown":
        owner = "library" if not frames else owner
    return owner, what, kind


def parse_log(text):
    findings = {}
    for rec in records(text):
        if rec[0].startswith(NOT_FINDINGS) or rec[0].startswith("Warning: Detected overflow"):
            continue
        owner, what, kind = classify(rec)
        key = (owner, what, kind)
        findings[key] = findings.get(key, 0) + 1
    m = re.search(PREFIX + r" ERROR SUMMARY: ([\d,]+) error", text)
    errors = int(m.group(1).replace(",", "")) if m else None
    r = re.search(PREFIX + r" RACECHECK SUMMARY: (.*)", text)
    leak = re.search(PREFIX + r" LEAK SUMMARY: (.*)", text)
    if errors is None and r:  # racecheck ends with its own summary line instead of ERROR SUMMARY
        n = re.search(r"\(([\d,]+) errors?", r.group(1))
        errors = int(n.group(1).replace(",", "")) if n else None
    out = {"error_summary": errors, "replay": [], "library": []}
    if r:
        out["racecheck_summary"] = r.group(1).strip()
    if leak:
        out["leak_summary"] = leak.group(1).strip()
    for (owner, what, kind), count in sorted(findings.items()):
        entry = {"kind": kind, "where": what, "count": count}
        if owner == "replay":
            out["replay"].append(entry)
        else:
            entry["owner"] = owner.split(":", 1)[1] if owner.startswith("library:") else owner
            out["library"].append(entry)
    return out


def read_run(path):
    """One run's log and its .meta sidecar (written by sanitize.sh: tool workload mode rc seconds)."""
    base = os.path.basename(path)[: -len(".log")]
    meta = {}
    meta_path = path[: -len(".log")] + ".meta"
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                meta[k] = v
    with open(path, errors="replace") as f:
        text = f.read()
    run = {"log": os.path.basename(path), "tool": meta.get("tool", base.split("_")[0]),
           "workload": meta.get("workload", ""), "mode": meta.get("mode", "")}
    rc = int(meta["rc"]) if meta.get("rc", "").lstrip("-").isdigit() else None
    run["exit_code"] = rc
    run["seconds"] = float(meta["seconds"]) if meta.get("seconds") else None
    run.update(parse_log(text))
    program_failed = "Target application returned an error" in text or \
        "process didn't terminate successfully" in text
    # The program's own error line ("replay-gpt3: ..."), which says what failed.
    m = re.search(r"^(replay-[a-z0-9]+: .*)$", text, re.M)
    if m:
        run["program_error"] = m.group(1)[:400]
    if rc == 124 or rc == 137:
        run["status"] = "timeout"
    elif any(e.get("owner") == "sanitizer" for e in run["library"]):
        run["status"] = "sanitizer failed"  # the tool itself (an internal error): nothing after it was checked
    elif run["error_summary"] is None:
        run["status"] = "incomplete"  # no ERROR SUMMARY: the sanitizer did not finish
    elif program_failed:
        run["status"] = "program failed"
    else:
        run["status"] = "complete"
    return run


def summarize(out_dir):
    logs = sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".log"))
    runs = [read_run(p) for p in logs if os.path.exists(p[: -len(".log")] + ".meta")]
    skipped = []
    skip_path = os.path.join(out_dir, "not_run.txt")
    if os.path.exists(skip_path):
        with open(skip_path) as f:
            skipped = [line.strip() for line in f if line.strip()]
    summary = {
        "runs": runs,
        "not_run": skipped,
        "replay_findings": sum(sum(e["count"] for e in r["replay"]) for r in runs),
        "library_findings": sum(sum(e["count"] for e in r["library"]) for r in runs),
        "incomplete": [r["log"] for r in runs if r["status"] != "complete"],
    }
    return summary


def markdown(summary):
    lines = ["| tool | workload | mode | status | s | replay's kernels | library findings |",
             "|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        lib = "; ".join(f"{e['count']}x {e['kind']} in {e['where']} ({e['owner']})" for e in r["library"])
        ours = "; ".join(f"{e['count']}x {e['kind']} in {e['where']}" for e in r["replay"])
        secs = f"{r['seconds']:.0f}" if r["seconds"] is not None else "-"
        status = r["status"]
        if status != "complete" and r.get("program_error"):
            status += ": " + r["program_error"][:160].replace("|", "/")
        lines.append(f"| {r['tool']} | {r['workload']} | {r['mode']} | {status} | {secs} | "
                     f"{ours or '0'} | {lib or '-'} |")
    for s in summary["not_run"]:
        lines.append(f"| {s} | not run |")
    lines.append("")
    lines.append(f"replay's findings: {summary['replay_findings']}; library findings: "
                 f"{summary['library_findings']}; runs not complete: {len(summary['incomplete'])}; "
                 f"not run: {len(summary['not_run'])}")
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print("usage: sanitize_summary.py OUT_DIR (the folder sanitize.sh wrote)", file=sys.stderr)
        return 2
    summary = summarize(argv[1])
    with open(os.path.join(argv[1], "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    text = markdown(summary)
    with open(os.path.join(argv[1], "summary.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)
    if summary["replay_findings"] > 0:
        return 1
    if summary["incomplete"] or summary["not_run"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
