"""kernel_stats reads both wrapper kinds Inductor writes: definitions and launches counted apart (identical kernel
sources are defined once and launched wherever they are needed), extern calls in order, CPU loop nests."""

from inkling_compiled.passes.kernel_stats import kernel_stats

# A Python wrapper as Inductor's Triton code generation writes it (trimmed from a real one: stock Inductor on two
# identical RMSNorms, then a GEMM): one kernel source, launched twice.
PYTHON_WRAPPER = """
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

CPP_WRAPPER = """
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
    s = kernel_stats(PYTHON_WRAPPER)
    assert (s.triton_kernels, s.triton_launches, s.cpp_kernels, s.cpp_launches) == (1, 2, 0, 0)
    assert s.extern_calls == ["mm"] and s.launches == 3


def test_cpp_wrapper_counts_kernels_launches_loop_nests_and_extern_ops():
    s = kernel_stats(CPP_WRAPPER)
    assert (s.cpp_kernels, s.cpp_launches, s.loop_nests, s.triton_kernels) == (2, 2, 3, 0)
    assert s.extern_calls == ["mm", "addmm"] and s.launches == 4
    both = kernel_stats([CPP_WRAPPER, PYTHON_WRAPPER]).to_dict()
    assert (both["kernels"], both["kernel_launches"], both["extern_ops"]) == (3, 4, ["addmm", "mm"])
