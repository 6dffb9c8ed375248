// The CUDA header's cudaMemcpyAttributes layout and constants, to compare with the ctypes
// mirror in kvdist/transfer/batchcopy.py (scripts/gpu/memcpy_attrs.py prints that one).
// nvcc -o /tmp/memcpy_attrs scripts/gpu/memcpy_attrs.cu && /tmp/memcpy_attrs
#include <cstdio>
#include <cstddef>
#include <cuda_runtime.h>
int main() {
  printf("header: CUDART_VERSION %d sizeof(cudaMemcpyAttributes) %zu offsets [%zu, %zu, %zu, %zu] "
         "SrcAccessOrderStream=%d FlagPreferOverlapWithCompute=%d\n", CUDART_VERSION,
         sizeof(cudaMemcpyAttributes), offsetof(cudaMemcpyAttributes, srcAccessOrder),
         offsetof(cudaMemcpyAttributes, srcLocHint), offsetof(cudaMemcpyAttributes, dstLocHint),
         offsetof(cudaMemcpyAttributes, flags), (int)cudaMemcpySrcAccessOrderStream,
         (int)cudaMemcpyFlagPreferOverlapWithCompute);
}
