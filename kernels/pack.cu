// Gather many small device tensors into one contiguous buffer (pinned, mapped host memory or device
// memory) with one launch, and scatter back: one transfer instead of hundreds of tiny ones.
// Grid: blockIdx.y is the tensor, blockIdx.x strides over its bytes. Offsets are 16-byte aligned by
// the launcher, so a tensor whose own address is 16-byte aligned moves as uint4 words.

__device__ void copy_bytes(unsigned char* __restrict__ dst, const unsigned char* __restrict__ src,
                           unsigned long long n, bool aligned) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long done = 0;
    if (aligned) {
        const unsigned long long words = n / 16;
        for (unsigned long long w = i; w < words; w += stride) {
            reinterpret_cast<uint4*>(dst)[w] = reinterpret_cast<const uint4*>(src)[w];
        }
        done = words * 16;
    }
    for (unsigned long long b = done + i; b < n; b += stride) dst[b] = src[b];
}

extern "C" __global__ void gather_bytes(const unsigned long long* __restrict__ src_ptrs,
                                        const unsigned long long* __restrict__ offsets,
                                        const unsigned long long* __restrict__ sizes,
                                        unsigned char* __restrict__ out) {
    const int t = blockIdx.y;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(src_ptrs[t]);
    copy_bytes(out + offsets[t], src, sizes[t], (src_ptrs[t] & 15) == 0);
}

extern "C" __global__ void scatter_bytes(const unsigned char* __restrict__ buffer,
                                         const unsigned long long* __restrict__ dst_ptrs,
                                         const unsigned long long* __restrict__ offsets,
                                         const unsigned long long* __restrict__ sizes) {
    const int t = blockIdx.y;
    unsigned char* dst = reinterpret_cast<unsigned char*>(dst_ptrs[t]);
    copy_bytes(dst, buffer + offsets[t], sizes[t], (dst_ptrs[t] & 15) == 0);
}
