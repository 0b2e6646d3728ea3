"""The examples a reader copies run as written: the README's "From Python" block and the
package docstring's."""

import re
from pathlib import Path

import numpy as np

import allreduce

README = Path(__file__).resolve().parents[2] / "README.md"


def run_example(code):
    scope = {}
    exec(compile(code, "<example>", "exec"), scope)
    for x in scope["xs"]:
        assert (x == np.float32(0 + 1 + 2 + 3)).all()
    for c in scope["comms"]:
        c.close()


def test_the_readme_example_runs():
    section = README.read_text().split("### From Python", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    assert len(code.strip().splitlines()) == 5
    run_example(code)


def test_the_package_docstring_example_runs():
    block = allreduce.__doc__.split("::\n\n", 1)[1].split("\n\n")[0]
    run_example("\n".join(line[4:] for line in block.splitlines()))
