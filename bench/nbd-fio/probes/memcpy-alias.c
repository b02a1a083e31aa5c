// 4 KiB memcpy from a page-aligned source into destinations at offsets -256..256 bytes from
// a page boundary, in ns per copy: shows the 4K-aliasing penalty behind `compression.rs`
// (session 18: ~100 ns everywhere except 1-31 bytes ahead of the source, 282-345 ns).
// build and run: gcc -O2 memcpy-alias.c -o /tmp/memcpy-alias && /tmp/memcpy-alias
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int main(void) {
    char *src = aligned_alloc(4096, 1 << 20);
    char *dst_base = aligned_alloc(4096, 1 << 16);
    memset(src, 1, 1 << 20);
    memset(dst_base, 2, 1 << 16);
    for (int off = -256; off <= 256; off += 16) {
        char *dst = dst_base + 8192 + off;
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int r = 0; r < 100; r++)
            for (int i = 0; i < 256; i++) {
                memcpy(dst, src + i * 4096, 4096);
                __asm__ volatile("" ::: "memory");
            }
        clock_gettime(CLOCK_MONOTONIC, &b);
        double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
        printf("%d:%.0f  ", off, ns / (100 * 256));
    }
    printf("\n");
    return 0;
}
