"""cuda_library: compiles .cu files with nvcc into a cc_library.

Package BUILD files never write nvcc command lines; they call

    cuda_library(
        name = "elementwise",
        srcs = ["elementwise.cu"],
        hdrs = ["elementwise.h"],
        deps = ["//engine:error"],
    )

and depend on the result like any cc_library. The architecture comes from the
build setting //tools/build_defs:cuda_arch (default sm_90a). Host code is
compiled with the same language standard, warnings and optimisation level as
the cc rules (see .bazelrc), always position-independent so the objects can
also go into the shared library of the Python binding.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

CudaArchInfo = provider(
    doc = "The GPU architecture nvcc compiles for.",
    fields = {"arch": "e.g. 'sm_90a' or 'sm_80'"},
)

def _cuda_arch_setting_impl(ctx):
    arch = ctx.build_setting_value
    if not arch.startswith("sm_") or not arch[3:].rstrip("a").isdigit():
        fail("cuda_arch must look like sm_90a or sm_80, got '%s'" % arch)
    return [CudaArchInfo(arch = arch)]

cuda_arch_setting = rule(
    implementation = _cuda_arch_setting_impl,
    build_setting = config.string(flag = True),
)

def _gencode(arch):
    # -gencode=arch=compute_90a,code=sm_90a: the arch-specific form also
    # assembles wgmma/setmaxnreg, which the -arch=sm_90a shorthand rejects in
    # its extra plain sm_90 pass on some nvcc versions.
    return "-gencode=arch=compute_%s,code=%s" % (arch[3:], arch)

def _optimisation_flags(ctx):
    mode = ctx.var.get("COMPILATION_MODE", "fastbuild")
    if mode == "opt":
        return ["-O3", "-DNDEBUG"]
    if mode == "dbg":
        return ["-O0", "-g"]
    return ["-O1"]

def _cuda_objects_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    arch = ctx.attr._arch[CudaArchInfo].arch

    compilation_contexts = [dep[CcInfo].compilation_context for dep in ctx.attr.deps if CcInfo in dep]
    headers = depset(ctx.files.hdrs, transitive = [c.headers for c in compilation_contexts])

    include_flags = ["-I.", "-I" + ctx.bin_dir.path]
    for c in compilation_contexts:
        include_flags += ["-I" + p for p in c.includes.to_list()]
        include_flags += ["-I" + p for p in c.quote_includes.to_list()]
        include_flags += [f for p in c.system_includes.to_list() for f in ["-isystem", p]]
        include_flags += ["-D" + d for d in c.defines.to_list()]

    host_flags = ["-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_objs/%s/%s.o" % (ctx.label.name, src.basename[:-len(src.extension) - 1]))
        args = ctx.actions.args()
        args.add_all([
            "-x",
            "cu",
            "-std=c++20",
            _gencode(arch),
            "-lineinfo",
            "--expt-relaxed-constexpr",
            "-ccbin",
            cc_toolchain.compiler_executable,
            "-Xcompiler",
            ",".join(host_flags),
        ])
        args.add_all(_optimisation_flags(ctx))
        args.add_all(include_flags)
        args.add_all(ctx.attr.copts)
        args.add_all(["-c", src.path, "-o", obj.path])
        ctx.actions.run(
            executable = ctx.executable._nvcc,
            arguments = [args],
            inputs = depset([src] + ctx.files._nvcc_files, transitive = [headers, cc_toolchain.all_files]),
            outputs = [obj],
            mnemonic = "Nvcc",
            progress_message = "Compiling CUDA %s (%s)" % (src.short_path, arch),
            use_default_shell_env = True,
        )
        objects.append(obj)
    return [DefaultInfo(files = depset(objects))]

_cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".h", ".cuh"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "_arch": attr.label(default = "//tools/build_defs:cuda_arch"),
        "_nvcc": attr.label(
            default = "@cuda//:nvcc",
            executable = True,
            cfg = "exec",
            allow_single_file = True,
        ),
        "_nvcc_files": attr.label(default = "@cuda//:nvcc_files", cfg = "exec"),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
)

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], visibility = None, **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc.

    Args:
      name: target name; depend on it like any cc_library.
      srcs: .cu files (nvcc), and .cc files (the host compiler; host
        references of the same kernel family live there).
      hdrs: headers the .cu files and the dependents include (.h or .cuh).
      deps: cc_library dependencies (their headers and defines reach nvcc).
      copts: extra nvcc flags (rarely needed; prefer none).
      visibility: as for cc_library.
      **kwargs: passed to the cc_library (tags, testonly, ...).
    """
    cu_srcs = [src for src in srcs if src.endswith(".cu")]
    cc_srcs = [src for src in srcs if not src.endswith(".cu")]
    _cuda_objects(
        name = name + "_nvcc",
        srcs = cu_srcs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:headers"],
        copts = copts,
        visibility = ["//visibility:private"],
        testonly = kwargs.get("testonly", False),
        tags = kwargs.get("tags", []),
    )
    native.cc_library(
        name = name,
        srcs = [":" + name + "_nvcc"] + cc_srcs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart"],
        visibility = visibility,
        **kwargs
    )
