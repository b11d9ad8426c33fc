// Gather many small device tensors into one contiguous buffer (pinned, mapped host memory or device
// memory) with one launch, and scatter back: one transfer instead of hundreds of tiny ones.
// Grid: blockIdx.y is the tensor, blockIdx.x strides over its bytes. Offsets are 16-byte aligned by
// the launcher, so a tensor whose own address is 16-byte aligned moves as uint4 words.

extern "C" __global__ void gather_bytes(const unsigned long long* __restrict__ src_ptrs,
                                        const unsigned long long* __restrict__ offsets,
                                        const unsigned long long* __restrict__ sizes,
                                        unsigned char* __restrict__ out) {
    const int t = blockIdx.y;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(src_ptrs[t]);
    unsigned char* dst = out + offsets[t];
    const unsigned long long n = sizes[t];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((reinterpret_cast<unsigned long long>(src) & 15) == 0) {
        const unsigned long long words = n / 16;
        for (unsigned long long w = i; w < words; w += stride) {
            reinterpret_cast<uint4*>(dst)[w] = reinterpret_cast<const uint4*>(src)[w];
        }
        for (unsigned long long b = words * 16 + i; b < n; b += stride) dst[b] = src[b];
    } else {
        for (unsigned long long b = i; b < n; b += stride) dst[b] = src[b];
    }
}

extern "C" __global__ void scatter_bytes(const unsigned char* __restrict__ buffer,
                                         const unsigned long long* __restrict__ dst_ptrs,
                                         const unsigned long long* __restrict__ offsets,
                                         const unsigned long long* __restrict__ sizes) {
    const int t = blockIdx.y;
    const unsigned char* src = buffer + offsets[t];
    unsigned char* dst = reinterpret_cast<unsigned char*>(dst_ptrs[t]);
    const unsigned long long n = sizes[t];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((reinterpret_cast<unsigned long long>(dst) & 15) == 0) {
        const unsigned long long words = n / 16;
        for (unsigned long long w = i; w < words; w += stride) {
            reinterpret_cast<uint4*>(dst)[w] = reinterpret_cast<const uint4*>(src)[w];
        }
        for (unsigned long long b = words * 16 + i; b < n; b += stride) dst[b] = src[b];
    } else {
        for (unsigned long long b = i; b < n; b += stride) dst[b] = src[b];
    }
}
