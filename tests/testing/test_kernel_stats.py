"""Kernel statistics read off Inductor's generated wrapper code: definitions, CPU loop nests, launches, extern
calls (on a hand-written wrapper in Inductor's layout, so no compile is needed)."""

from inkling_compiled.testing.kernel_stats import KernelStats, kernel_stats, outer_loops

CPP_SOURCE = """
extern "C" void kernel(const float* in_ptr0, float* out_ptr0)
{
    for (long x0 = 0; x0 < 8; x0 += 1)
    {
        for (long x1 = 0; x1 < 4; x1 += 1)
        {
            out_ptr0[x1 + 4 * x0] = in_ptr0[x1 + 4 * x0];
        }
    }
    {
        for (long x0 = 0; x0 < 8; x0 += 1)
        {
            out_ptr0[x0] += 1.0f;
        }
    }
}
"""

WRAPPER = f"""
cpp_fused_add_copy_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''{CPP_SOURCE}''')

async_compile.wait(globals())


def call(args):
    arg0_1, arg1_1 = args
    buf0 = empty_strided_cpu((8, 4), (4, 1), torch.float32)
    cpp_fused_add_copy_0(arg0_1, buf0)
    buf1 = empty_strided_cpu((8, 8), (8, 1), torch.float32)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    extern_kernels.addmm(buf1, buf0, arg1_1, alpha=0.5, out=buf1)
    return (buf1, )
"""


def test_outer_loops_counts_only_loops_outside_every_other_loop():
    assert outer_loops(CPP_SOURCE) == 2  # the nested x1 loop is inside x0's; a bare brace block is not a loop
    assert outer_loops("void f() { }") == 0


def test_wrapper_statistics():
    stats = kernel_stats(WRAPPER)
    assert stats == KernelStats(cpp_kernels=1, triton_kernels=0, loop_nests=2, kernel_launches=1,
                                extern_calls=["mm", "addmm"])
    assert (stats.kernels, stats.launches) == (1, 3)


def test_several_wrappers_add_up():
    assert kernel_stats([WRAPPER, WRAPPER]) == kernel_stats(WRAPPER) + kernel_stats(WRAPPER)
    assert kernel_stats([WRAPPER, WRAPPER]).extern_calls == ["mm", "addmm"] * 2
