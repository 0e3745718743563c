"""Kernel statistics read off Inductor's generated wrapper code: definitions, CPU loop nests, launches, extern
calls (on hand-written wrappers in Inductor's layouts, so no compile is needed). Identical kernel sources are
defined once and launched wherever they are needed, so definitions and launches are counted apart."""

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
    assert stats == KernelStats(cpp_kernels=1, triton_kernels=0, loop_nests=2, cpp_launches=1,
                                extern_calls=["mm", "addmm"])
    assert (stats.kernels, stats.launches) == (1, 3)


def test_several_wrappers_add_up():
    assert kernel_stats([WRAPPER, WRAPPER]) == kernel_stats(WRAPPER) + kernel_stats(WRAPPER)
    assert kernel_stats([WRAPPER, WRAPPER]).extern_calls == ["mm", "addmm"] * 2

# A Python wrapper as Inductor's Triton code generation writes it (trimmed from a real one: stock Inductor on two
# identical RMSNorms, then a GEMM): one kernel source, launched twice.
TRITON_WRAPPER = """
from torch._inductor.select_algorithm import extern_kernels
async_compile = AsyncCompile()

triton_per_fused_rsqrt_0 = async_compile.triton('triton_per_fused_rsqrt_0', '''
import triton
@triton.jit
def triton_per_fused_rsqrt_0(in_ptr0, in_ptr1, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 28
''', device_str='cuda')

async_compile.wait(globals())
del async_compile

def call(args):
    arg0_1, arg1_1, arg2_1, arg3_1, arg4_1 = args
    buf4 = empty_strided_cuda((28, 128), (128, 1), torch.bfloat16)
    stream0 = get_raw_stream(0)
    triton_per_fused_rsqrt_0.run(arg0_1, arg1_1, buf4, 28, 64, stream=stream0)
    triton_per_fused_rsqrt_0.run(arg2_1, arg3_1, reinterpret_tensor(buf4, (28, 64), (128, 1), 64), 28, 64,
                                 stream=stream0)
    buf5 = empty_strided_cuda((28, 96), (96, 1), torch.bfloat16)
    extern_kernels.mm(buf4, arg4_1, out=buf5)
    return (buf5, )
"""

AOTI_WRAPPER = """
extern "C"  void  cpp_fused_a_0(const float* in_ptr0, float* out_ptr0);
extern "C"  void  cpp_fused_b_1(const float* in_ptr0, float* out_ptr0);
void inductor_entry_impl() {
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, a, b, f32, cpu, 0, &buf0_handle));
    cpp_fused_a_0((const float*)(arg0_1.data_ptr()), (float*)(buf0.data_ptr()));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(buf1, buf0, arg1_1));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_addmm_out(buf2, buf3, buf1, arg2_1, 0L, 0.5));
    cpp_fused_b_1((const float*)(buf2.data_ptr()), (float*)(buf4.data_ptr()));
}
extern "C"  void  cpp_fused_a_0(const float* in_ptr0, float* out_ptr0)
{
    #pragma omp parallel
    {
        for(int64_t x0=0; x0<64; x0++) { for(int64_t x1=0; x1<4; x1++) { out_ptr0[x0] += in_ptr0[x1]; } }
        for(int64_t x0=0; x0<64; x0++) { out_ptr0[x0] *= 2; }
    }
}
extern "C"  void  cpp_fused_b_1(const float* in_ptr0, float* out_ptr0)
{
    for(int64_t x0=0; x0<8; x0++) { out_ptr0[x0] = in_ptr0[x0]; }
}
"""


def test_python_wrapper_counts_one_definition_launched_twice():
    s = kernel_stats(TRITON_WRAPPER)
    assert (s.triton_kernels, s.triton_launches, s.cpp_kernels, s.cpp_launches) == (1, 2, 0, 0)
    assert s.extern_calls == ["mm"] and s.launches == 3


def test_cpp_wrapper_counts_kernels_launches_loop_nests_and_extern_ops():
    s = kernel_stats(AOTI_WRAPPER)
    assert (s.cpp_kernels, s.cpp_launches, s.loop_nests, s.triton_kernels) == (2, 2, 3, 0)
    assert s.extern_calls == ["mm", "addmm"] and s.launches == 4
    both = kernel_stats([AOTI_WRAPPER, TRITON_WRAPPER]).to_dict()
    assert (both["kernels"], both["kernel_launches"], both["extern_ops"]) == (3, 4, ["addmm", "mm"])
