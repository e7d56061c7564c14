"""Preflight for ``--compile``: what inductor needs on this machine, checked before any rank exists.

On CPU inductor builds C++ kernels: a C++ compiler (``$CXX``, else ``g++``). On CUDA it builds
Triton kernels: the Triton this torch was built against. On both, the cache directory
(:mod:`wan_s2v_runner.shared.inductor`) must be writable and its path free of spaces (the C++
build's command line is split on them; measured on CPU, refused on CUDA too, where a C++ wrapper
or host kernel would meet the same). The compiler and Triton come from the machine's facts (the
probe); the cache directory from the launcher's environment, which the ranks inherit.
"""
from __future__ import annotations

from wan_s2v_runner.shared.inductor import CACHE_ENV, cache_dir, cpp_build_refuses

from .checks_inputs import writable_dir
from .core import fail, ok, skip

ID = "engine.compile"


def check_compile(ctx):
    if not getattr(ctx.spec, "compile", False):
        return skip(ID, "--compile not asked (the DiT runs eager)")
    tools = ctx.facts.raw.get("compile")
    cache = cache_dir(setting=ctx.spec.cache_dir)
    if tools is None:
        return skip(ID, "this machine's facts say nothing about compilers (recorded before --compile existed)")
    if ctx.spec.device == "cpu":
        if not tools.get("cxx"):
            return fail(ID, f"--compile on CPU needs a C++ compiler (inductor builds C++ kernels): "
                            f"{tools.get('cxx_name') or 'g++'} not found",
                        "apt-get install g++ (or set CXX to a C++ compiler), or drop --compile")
        tool = f"C++ compiler {tools['cxx']}"
    else:
        have, want = tools.get("triton"), tools.get("triton_required")
        if not have:
            return fail(ID, "--compile on CUDA needs Triton (inductor builds Triton kernels): not installed",
                        f"pip install triton{'==' + want if want else ''}, or drop --compile")
        if want and have.split("+")[0] != want.split("+")[0]:
            return fail(ID, f"Triton {have} is installed, this torch was built with Triton {want}",
                        f"pip install triton=={want}, or drop --compile", triton=have, triton_required=want)
        tool = f"Triton {have}"
    refused = cpp_build_refuses(cache)  # on CUDA too: inductor builds some host code there (not measured)
    if refused:
        return fail(ID, refused, f"set {CACHE_ENV} to a directory whose path has no spaces, or drop --compile",
                    cache_dir=str(cache))
    good, why, _ = writable_dir(cache)
    if not good:
        return fail(ID, f"the compile cache {cache} is not writable ({why})",
                    f"set {CACHE_ENV} to a writable directory, or drop --compile", cache_dir=str(cache))
    return ok(ID, f"{tool}; compiled kernels cached in {cache}", cache_dir=str(cache))
