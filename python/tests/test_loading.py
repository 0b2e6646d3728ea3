"""Where the library is looked for, and what a missing one looks like. Each case runs in a
fresh interpreter: the library, once loaded, stays loaded for the process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import allreduce
from allreduce import _lib

PROBE = """
import json, allreduce
from allreduce import _lib
out = {"candidates": [str(p) for p in _lib.candidates()]}
try:
    allreduce.Communicator.group(2)
except allreduce.LibraryNotFound as e:
    out["error"] = str(e)
    out["tried"] = e.tried
    out["is_error"] = isinstance(e, allreduce.Error)
print(json.dumps(out))
"""


def probe(lib):
    env = {k: v for k, v in os.environ.items() if k != _lib.ENV_VAR}
    if lib is not None:
        env[_lib.ENV_VAR] = str(lib)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def test_the_library_in_use_is_the_one_named_by_the_environment():
    assert Path(allreduce.library_path()) == Path(os.environ[_lib.ENV_VAR])


def test_an_explicit_path_that_does_not_exist_fails_on_first_use_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / _lib.LIB_NAME
    out = probe(missing)
    assert out["candidates"] == [str(missing)], "an explicit path is the only candidate"
    assert out["tried"] == [[str(missing), "no such file"]]
    assert out["is_error"]
    assert str(missing) in out["error"] and "ALLREDUCE_LIB" in out["error"]


def test_a_file_that_is_not_a_library_is_passed_over_with_the_loaders_reason(tmp_path):
    bogus = tmp_path / _lib.LIB_NAME
    bogus.write_text("not a shared object")
    out = probe(bogus)
    (path, why), = out["tried"]
    assert path == str(bogus) and why.startswith("could not be loaded")


def test_without_the_variable_the_package_copy_then_the_repository_builds_are_tried():
    out = probe(None)
    package = Path(_lib.__file__).resolve().parent
    repo = package.parent.parent
    assert out["candidates"] == [
        str(package / _lib.LIB_NAME),
        str(repo / "target" / "release" / _lib.LIB_NAME),
        str(repo / "target" / "debug" / _lib.LIB_NAME),
    ]
