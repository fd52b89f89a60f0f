"""The release of ckpt_offload: the one place it is written. The package (`ckpt_offload.__version__`),
the packaging metadata (pyproject.toml's dynamic version) and the env report read it from here.

Standard library only, and no import of the package: the build reads it before anything is compiled.
"""
__version__ = "0.1.0"
