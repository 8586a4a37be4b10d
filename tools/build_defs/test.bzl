"""Test macros: every C++ test is a GoogleTest cc_test; GPU tests are tagged.

    sg_cc_test(name = "shape_test", srcs = ["shape_test.cc"], deps = ["//engine:shape"])
    sg_cc_test(name = "stream_test", srcs = ["stream_test.cc"], deps = [...], gpu = True)
    gpu_test_bundle()   # last in a BUILD file that has GPU tests

A GPU test runs everywhere: it skips (GTEST_SKIP, with the reason) where no
GPU is present, so `bazel test //...` stays green on the build machines and
`.ci/run` counts it as skipped. tools/gpu_bundle.sh carries one binary per
test package to the GPU machines: gpu_test_bundle() links every GPU test of
its package into `gpu_tests`, so the bundle has few binaries, not many.
"""

_GPU_TAG = "gpu"
_BUNDLE_TAG = "gpu_bundle"

def sg_cc_test(name, srcs, deps = [], gpu = False, tags = [], size = "small", **kwargs):
    """A GoogleTest test; with gpu = True, also part of the package's GPU bundle."""
    test_tags = tags + ([_GPU_TAG] if gpu else [])
    native.cc_library(
        name = name + "_cases",
        testonly = True,
        srcs = srcs,
        deps = deps + ["@googletest//:gtest"],
        # Test cases register themselves at static-init time; nothing
        # references them by name, so the linker must keep them.
        alwayslink = True,
        tags = test_tags,
    )
    native.cc_test(
        name = name,
        deps = [":" + name + "_cases", "@googletest//:gtest_main"],
        tags = test_tags,
        size = size,
        **kwargs
    )

def gpu_test_bundle(name = "gpu_tests"):
    """One binary with every GPU test of this package, for the GPU bundle."""
    cases = [
        ":" + rule["name"] + "_cases"
        for rule in native.existing_rules().values()
        if rule["kind"] == "cc_test" and _GPU_TAG in rule.get("tags", [])
    ]
    if not cases:
        fail("gpu_test_bundle(): this package has no sg_cc_test(..., gpu = True)")
    native.cc_test(
        name = name,
        deps = sorted(cases) + ["@googletest//:gtest_main"],
        # Built only by tools/gpu_bundle.sh; each test already runs in //...
        tags = ["manual", _BUNDLE_TAG],
    )
