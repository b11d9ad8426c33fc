// Copy many small tensors into one contiguous buffer (pinned, mapped host memory or device memory)
// with one launch, and back: one transfer instead of hundreds of tiny ones.
// Each copy t moves sizes[t] bytes from src[t] to dst[t] (absolute addresses, built by pack.py).
// Grid: blockIdx.y strides over the copies (gridDim.y is capped at 65535), blockIdx.x over a
// copy's bytes. vector_ok[t] says both addresses are 16-byte aligned, so the copy moves uint4 words.

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

extern "C" __global__ void copy_many(const unsigned long long* __restrict__ src,
                                     const unsigned long long* __restrict__ dst,
                                     const unsigned long long* __restrict__ sizes,
                                     const unsigned long long* __restrict__ vector_ok,
                                     unsigned long long count) {
    for (unsigned long long t = blockIdx.y; t < count; t += gridDim.y) {
        copy_bytes(reinterpret_cast<unsigned char*>(dst[t]), reinterpret_cast<const unsigned char*>(src[t]), sizes[t],
                   vector_ok[t] != 0);
    }
}
