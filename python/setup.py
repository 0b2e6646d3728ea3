"""A platform wheel when the package carries the library (python/build-wheel.sh copies it in),
a pure one otherwise: the metadata is all in pyproject.toml."""
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.dist import Distribution

_HERE = Path(__file__).resolve().parent / "allreduce"
_BUNDLED = any((_HERE / n).is_file()
               for n in ("liballreduce_c.so", "liballreduce_c.dylib", "allreduce_c.dll"))


class _Distribution(Distribution):
    def has_ext_modules(self):
        # A bundled native library ties the wheel to this platform.
        return _BUNDLED


class _Wheel(bdist_wheel):
    def get_tag(self):
        python, abi, plat = super().get_tag()
        # The binding is ctypes: any CPython 3 loads the library, so no Python or ABI tag.
        return ("py3", "none", plat) if _BUNDLED else (python, abi, plat)


setup(distclass=_Distribution, cmdclass={"bdist_wheel": _Wheel})
