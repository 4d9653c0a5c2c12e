"""The native splice (proxy/wire/_splice.c) is built here; everything else is in
pyproject.toml. ``optional=True``: on a machine without a C compiler the install still
succeeds and the proxy runs the pure-Python splice, saying so loudly at start."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.wire._splice",
            sources=["proxy/wire/_splice.c", "proxy/wire/_snappy_edit.c"],
            depends=["proxy/wire/_snappy_edit.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
            optional=True,
        )
    ],
)
