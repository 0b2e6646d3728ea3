"""The binding's tables against the C header they were written from: a code, enum value or
function signature changed or added there without the binding following fails here."""

import ctypes
import re
from pathlib import Path

import pytest

import allreduce
from allreduce import _buffers, _comm, _errors, _fused, _lib

HEADER = Path(__file__).resolve().parents[2] / "crates" / "capi" / "include" / "allreduce.h"


def header_enum(name):
    """``{NAME: value}`` of the header's ``typedef enum { ... } name;``."""
    text = HEADER.read_text()
    body = re.search(r"typedef enum \{([^}]*)\}\s*" + name + ";", text)
    assert body, f"{name} not in {HEADER}"
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s*(AR_\w+)\s*=\s*(-?\d+),", body[1], re.M)}


def test_every_result_code_of_the_header_has_its_exception_class():
    codes = header_enum("ar_result_t")
    assert len(codes) > 20
    assert codes == _errors.CODES
    for name, value in codes.items():
        if name == "AR_SUCCESS":
            continue
        cls = _errors.CLASSES[name]
        assert issubclass(cls, allreduce.Error)
        assert getattr(allreduce, cls.__name__) is cls, f"{cls.__name__} is not exported"
        e = _errors.from_code(value, "the message")
        assert type(e) is cls and e.code == value and e.code_name == name
        assert str(e) == f"{name}: the message"


def test_the_library_knows_every_code_the_binding_maps():
    lib = _lib.lib()
    for name, value in _errors.CODES.items():
        assert lib.ar_get_error_string(value) != b"unknown result code", name
    assert lib.ar_get_error_string(len(_errors.CODES)) == b"unknown result code"


def test_exception_classes_are_also_the_builtin_kinds_callers_expect():
    assert issubclass(allreduce.InvalidArgument, ValueError)
    assert issubclass(allreduce.InvalidConfig, ValueError)
    assert issubclass(allreduce.UnsupportedType, TypeError)
    assert issubclass(allreduce.UnsupportedType, allreduce.InvalidArgument)
    for cls in (allreduce.Misaligned, allreduce.LengthMismatch, allreduce.DTypeMismatch,
                allreduce.TooLarge, allreduce.WrongDevice, allreduce.UnsupportedCodec):
        assert issubclass(cls, allreduce.InvalidArgument)
    assert issubclass(allreduce.LibraryNotFound, allreduce.Error)
    rebuild = {c.code_name for c in _errors.CLASSES.values() if c.rebuild}
    assert rebuild == {"AR_TIMEOUT", "AR_ABORTED", "AR_DEVICE_ERROR", "AR_BOOTSTRAP_ERROR",
                       "AR_INTERNAL_ERROR"}


def test_an_unknown_code_is_an_internal_error_not_a_success():
    e = _errors.from_code(99, "from a newer library")
    assert isinstance(e, allreduce.InternalError) and e.code == 99 and e.rebuild
    assert "99" in str(e)


def test_argument_names_map_to_the_header_values():
    precisions = {k[len("AR_"):].lower(): v for k, v in header_enum("ar_precision_t").items()}
    assert precisions == _comm.PRECISIONS
    strategies = {k[len("AR_STRATEGY_"):].lower(): v
                  for k, v in header_enum("ar_strategy_t").items()}
    assert strategies == _comm.STRATEGIES
    backends = {k[len("AR_BACKEND_"):].lower(): v for k, v in header_enum("ar_backend_t").items()}
    assert backends == _comm.BACKENDS
    assert header_enum("ar_dtype_t") == {
        "AR_FLOAT16": _buffers.F16, "AR_FLOAT32": _buffers.F32, "AR_BFLOAT16": _buffers.BF16}
    assert header_enum("ar_red_op_t") == {"AR_SUM": _comm._AR_SUM}
    patterns = {k[len("AR_FUSED_"):].lower(): v
                for k, v in header_enum("ar_fused_pattern_t").items()}
    assert patterns == _fused.FUSED_PATTERNS


def test_prototypes_match_the_header():
    text = HEADER.read_text()
    version = re.search(r"#define AR_VERSION_CODE (\d+)", text)
    assert int(version[1]) == _lib.VERSION_CODE
    for name, (_, argtypes) in _lib.PROTOTYPES.items():
        decl = re.search(r"\b" + name + r"\(([^)]*)\);", text)
        assert decl, f"{name} is not declared in the header"
        params = [p for p in decl[1].split(",") if p.strip() not in ("", "void")]
        assert len(params) == len(argtypes), name
        for param, argtype in zip(params, argtypes):
            is_pointer = "*" in param or re.search(r"\bar_(comm|fused_workspace)_t\b", param)
            assert bool(is_pointer) == (argtype in (ctypes.c_void_p, ctypes.c_char_p) or
                                        hasattr(argtype, "contents")), (name, param)
    fields = re.search(r"typedef struct \{([^}]*)\} ar_config_t;", text)[1]
    declared = re.findall(r"^\s*(size_t|uint32_t) (\w+);", fields, re.M)
    assert [n for _, n in declared] == [n for n, _ in _lib.Config._fields_]
    # ar_fused_args_t, field by field: its name and C type against the ctypes one.
    fields = re.search(r"typedef struct \{([^}]*)\} ar_fused_args_t;", text)[1]
    declared = re.findall(r"^\s*((?:const )?\w+ \*?)(\w+);", fields, re.M)
    ctype = {"size_t": ctypes.c_size_t, "int": ctypes.c_int, "float": ctypes.c_float}
    assert [(n, ctype.get(t.strip(), ctypes.c_void_p if "*" in t else None))
            for t, n in declared] == _lib.FusedArgs._fields_


@pytest.mark.parametrize("name", sorted(_lib.PROTOTYPES))
def test_every_prototype_is_exported_by_the_loaded_library(name):
    assert getattr(_lib.lib(), name).argtypes is not None


def test_the_default_timeout_is_the_headers():
    """``timeout=None`` means the library's one default deadline, AR_DEFAULT_TIMEOUT_MS."""
    found = re.search(r"#define AR_DEFAULT_TIMEOUT_MS (\d+)", HEADER.read_text())
    assert found, f"AR_DEFAULT_TIMEOUT_MS not in {HEADER}"
    assert int(found[1]) == round(_lib.DEFAULT_TIMEOUT_S * 1000)
