#!/usr/bin/env python3
"""The troubleshooting set stays whole (label cpu): every exercise folder has its program and README,
a build target (exercises/CMakeLists.txt), a broken and a fixed test (tests/exercises/CMakeLists.txt),
a row in exercises/README.md and a catalogue entry that links it; every target's folder exists; and
every fault `--inject` plants (graphs/faults.cu's catalogue) is named in exercises/CATALOGUE.md.

The project's root comes from REPLAY_SOURCE_DIR (CTest sets it) or this file's place."""

import os
import re
import sys
import unittest

ROOT = os.environ.get("REPLAY_SOURCE_DIR") or os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
EX = os.path.join(ROOT, "exercises")
FOLDER = re.compile(r"^[CNMHP]\d+[A-Za-z0-9-]*$")


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def folders():
    return sorted(d for d in os.listdir(EX) if FOLDER.match(d) and os.path.isdir(os.path.join(EX, d)))


def targets():
    """{target suffix: folder} from exercises/CMakeLists.txt."""
    return dict(re.findall(r"^replay_add_exercise\((\S+)\s+(\S+?)[\s)]", read("exercises", "CMakeLists.txt"), re.M))


def tests():
    """{(target suffix, mode)} from tests/exercises/CMakeLists.txt."""
    text = read("tests", "exercises", "CMakeLists.txt")
    return set(re.findall(r"^replay_exercise_test\((\S+)\s+(broken|fixed)\b", text, re.M))


def faults():
    """The --inject names of graphs/faults.cu's catalogue."""
    return re.findall(r"\{Fault::k\w+,\s*\"([a-z-]+)\"", read("graphs", "faults.cu"))


class ExercisesIndex(unittest.TestCase):
    def test_the_parsers_find_the_set(self):
        # A parser that found nothing would make every check below pass.
        self.assertGreaterEqual(len(folders()), 30)
        self.assertGreaterEqual(len(targets()), 30)
        self.assertGreaterEqual(len(tests()), 60)
        self.assertGreaterEqual(len(faults()), 10)

    def test_every_folder_has_its_program_and_readme(self):
        for d in folders():
            for name in ("main.cu", "README.md"):
                self.assertTrue(os.path.isfile(os.path.join(EX, d, name)), f"exercises/{d}/{name} is missing")

    def test_every_folder_is_built_and_every_target_has_its_folder(self):
        built = targets()
        self.assertEqual(sorted(set(built.values())), folders(),
                         "exercises/CMakeLists.txt's replay_add_exercise folders against the folders on disk")

    def test_every_target_has_a_broken_and_a_fixed_test(self):
        have = tests()
        for suffix, folder in targets().items():
            for mode in ("broken", "fixed"):
                self.assertIn((suffix, mode), have, f"no exercise.{suffix}.{mode} test for {folder}")
        for suffix, _ in have:
            self.assertIn(suffix, targets(), f"a test of exercise-{suffix}, which nothing builds")

    def test_every_folder_is_indexed_and_catalogued(self):
        index, catalogue = read("exercises", "README.md"), read("exercises", "CATALOGUE.md")
        for d in folders():
            link = f"]({d}/README.md)"
            self.assertTrue(link in index, f"exercises/README.md has no row linking {d}")
            self.assertTrue(link in catalogue, f"exercises/CATALOGUE.md does not link {d}")

    def test_every_injected_fault_is_in_the_catalogue(self):
        catalogue = read("exercises", "CATALOGUE.md")
        for name in faults():
            self.assertTrue(re.search(rf"`(--inject )?{re.escape(name)}`", catalogue),
                            f"--inject {name} is not named in exercises/CATALOGUE.md")


if __name__ == "__main__":
    unittest.main()
