#!/usr/bin/env python3
"""scripts/compare_builds.py on the CPU: case parsing, the command each build runs, and the table row
a pair of builds' runs give (same or different hashes, failed runs, the step-time ratio)."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import compare_builds as cb  # noqa: E402


def run(loss, weights, ms):
    return {"loss_hash": loss, "weights_hash": weights, "step_ms": {"median": ms}}


class CompareBuildsTest(unittest.TestCase):
    def test_case_parsing(self):
        c = cb.parse_case("gpt3 tiny full 20 --host-delay-us 20")
        self.assertEqual((c["workload"], c["preset"], c["mode"], c["steps"]), ("gpt3", "tiny", "full", 20))
        self.assertEqual(c["extra"], ["--host-delay-us", "20"])
        self.assertEqual(c["name"], "gpt3_tiny_full_20_host-delay-us_20")
        for bad in ("gpt3 tiny full", "gpt3 tiny full many"):
            with self.assertRaises(ValueError):
                cb.parse_case(bad)

    def test_command_names_the_build_and_the_seed(self):
        cmd = cb.command("/old/bin", cb.parse_case("llama31 405b-tp8 layer 5"), 1234, "/out/x.json")
        self.assertEqual(cmd, ["/old/bin/replay-llama31", "--preset", "405b-tp8", "--graphs", "layer",
                               "--steps", "5", "--seed", "1234", "--json", "/out/x.json"])

    def test_same_hashes_and_the_ratio_of_median_step_times(self):
        case = cb.parse_case("gpt3 tiny none 20")
        row = cb.compare(case, [run("a", "w", 2.0), run("a", "w", 4.0)], [run("a", "w", 3.0), run("a", "w", 3.0)])
        self.assertEqual(row["failed"], [])
        self.assertTrue(row["same_loss_hash"] and row["same_weights_hash"])
        self.assertEqual((row["old_ms"], row["new_ms"]), (3.0, 3.0))
        self.assertAlmostEqual(row["ratio"], 1.0)
        self.assertIn("| gpt3_tiny_none_20 | yes | yes | 3.000 | 3.000 | 1.000 |", cb.markdown([row]))

    def test_a_differing_hash_or_a_failed_run_is_said(self):
        case = cb.parse_case("gpt3 tiny none 20")
        row = cb.compare(case, [run("a", "w", 1.0)], [run("b", "w", 1.0)])
        self.assertFalse(row["same_loss_hash"])
        self.assertTrue(row["same_weights_hash"])
        self.assertIn("**no**", cb.markdown([row]))
        # Two runs of the new build that disagree with each other are not "the same".
        row = cb.compare(case, [run("a", "w", 1.0)], [run("a", "w", 1.0), run("a", "v", 1.0)])
        self.assertFalse(row["same_weights_hash"])
        row = cb.compare(case, [run("a", "w", 1.0)], [None])
        self.assertEqual(row["failed"], ["new"])
        self.assertIn("failed (new)", cb.markdown([row]))


if __name__ == "__main__":
    unittest.main()
