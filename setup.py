"""The native splice (proxy/wire/_splice.c, with the snappy edit and the RW 2.0 -> 1.0
conversion) is built here; everything else is in pyproject.toml. ``optional=True``: on a
machine without a C compiler the install still succeeds and the proxy runs the pure-Python
splice and conversion, saying so loudly at start."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.wire._splice",
            sources=["proxy/wire/_splice.c", "proxy/wire/_snappy_edit.c",
                     "proxy/wire/_convert.c"],
            depends=["proxy/wire/_snappy_edit.h", "proxy/wire/_convert.h", "proxy/wire/_wire.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
            optional=True,
        )
    ],
)
