/* Timed EXTENDED COPY (LID1) between two LUNs of one target, for bench/iscsi/run.sh.
 * The login, VPD 83h NAA lookup and descriptor encoding are those of
 * crates/ibid-iscsi/tests/c/ibid_initiator.c (the test initiator); this adds
 * large copies (many segments per command) and timing.
 *
 *   iscsi_xcopy PORTAL IQN SRC_LUN DST_LUN BYTES [SAMPLES]
 *
 * Copies BYTES from LBA 0 of SRC_LUN to LBA 0 of DST_LUN with EXTENDED COPY
 * commands sent to SRC_LUN: 16 MiB block->block segments, at most 128 segments
 * (2 GiB) per command (ibid's limits; RECEIVE COPY RESULTS / VPD 8Fh), one
 * command at a time. Then reads SAMPLES (default 32) 1 MiB ranges at
 * pseudo-random offsets from both LUNs and compares them.
 * Prints "xcopy_seconds S commands N verified K"; exit status 0 on success,
 * 3 if the target rejected EXTENDED COPY (prints the sense), 1 otherwise.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>

#define BS 512
#define SEG_BLOCKS 32768 /* 16 MiB */
#define MAX_SEGS 128

static struct iscsi_context *login(const char *portal, const char *iqn, int lun) {
    struct iscsi_context *c = iscsi_create_context("iqn.2026-11.org.ibid:bench-xcopy");
    if (!c) { fprintf(stderr, "no context\n"); exit(2); }
    iscsi_set_targetname(c, iqn);
    iscsi_set_session_type(c, ISCSI_SESSION_NORMAL);
    iscsi_set_header_digest(c, ISCSI_HEADER_DIGEST_NONE);
    if (iscsi_full_connect_sync(c, portal, lun) != 0) {
        fprintf(stderr, "login failed: %s\n", iscsi_get_error(c));
        exit(2);
    }
    return c;
}

static int ok(struct scsi_task *t, const char *what) {
    if (t == NULL || t->status != SCSI_STATUS_GOOD) {
        fprintf(stderr, "%s failed: status %d sense key %x asc/ascq %04x\n", what,
                t ? t->status : -1, t ? t->sense.key : 0, t ? t->sense.ascq : 0);
        return 0;
    }
    return 1;
}

static int naa_of(struct iscsi_context *c, int lun, unsigned char out[16]) {
    struct scsi_task *t = iscsi_inquiry_sync(c, lun, 1, 0x83, 255);
    if (!ok(t, "inquiry 83")) return 0;
    unsigned char *d = t->datain.data;
    int len = (d[2] << 8 | d[3]) + 4;
    for (int p = 4; p + 4 <= len && p < t->datain.size; p += 4 + d[p + 3]) {
        /* association LU, type NAA, 16 bytes (IEEE registered extended) */
        if ((d[p + 1] & 0x0f) == 3 && (d[p + 1] & 0x30) == 0 && d[p + 3] == 16) {
            memcpy(out, d + p + 4, 16);
            scsi_free_scsi_task(t);
            return 1;
        }
    }
    scsi_free_scsi_task(t);
    return 0;
}

static void target_desc(unsigned char *d, const unsigned char naa[16]) {
    memset(d, 0, 32);
    d[0] = 0xe4;           /* identification descriptor */
    d[4] = 0x01;           /* code set binary */
    d[5] = 0x03;           /* association LU, type NAA */
    d[7] = 16;
    memcpy(d + 8, naa, 16);
    d[30] = BS >> 8;       /* disk block length */
}

static void seg_desc(unsigned char *d, int blocks, uint64_t src_lba, uint64_t dst_lba) {
    memset(d, 0, 28);
    d[0] = 0x02;           /* block -> block */
    d[3] = 24;
    d[5] = 0;              /* source: target descriptor 0 */
    d[7] = 1;              /* destination: target descriptor 1 */
    d[10] = blocks >> 8;
    d[11] = blocks & 0xff;
    for (int i = 0; i < 8; i++) {
        d[12 + i] = src_lba >> (56 - 8 * i);
        d[20 + i] = dst_lba >> (56 - 8 * i);
    }
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s PORTAL IQN SRC_LUN DST_LUN BYTES [SAMPLES]\n", argv[0]);
        return 1;
    }
    const char *portal = argv[1], *iqn = argv[2];
    int src = atoi(argv[3]), dst = atoi(argv[4]);
    uint64_t blocks = strtoull(argv[5], NULL, 10) / BS;
    int samples = argc > 6 ? atoi(argv[6]) : 32;
    struct iscsi_context *c = login(portal, iqn, src);
    unsigned char a[16], b[16];
    if (!naa_of(c, src, a) || !naa_of(c, dst, b)) { fprintf(stderr, "no NAA designator\n"); return 1; }

    size_t plen = 16 + 64 + 28 * MAX_SEGS;
    unsigned char *p = malloc(plen);
    uint64_t lba = 0, t0 = now_ns();
    int commands = 0;
    while (lba < blocks) {
        int nseg = 0;
        memset(p, 0, plen);
        target_desc(p + 16, a);
        target_desc(p + 48, b);
        while (nseg < MAX_SEGS && lba < blocks) {
            uint64_t n = blocks - lba < SEG_BLOCKS ? blocks - lba : SEG_BLOCKS;
            seg_desc(p + 80 + 28 * nseg, (int)n, lba, lba);
            lba += n;
            nseg++;
        }
        p[1] = 3 << 3;     /* LIST ID USAGE: none */
        p[3] = 64;         /* target descriptor list length */
        uint32_t sl = 28 * nseg;
        p[8] = sl >> 24; p[9] = sl >> 16; p[10] = sl >> 8; p[11] = sl;
        struct iscsi_data data = { 80 + sl, p };
        struct scsi_task *t = iscsi_extended_copy_sync(c, src, &data);
        if (!ok(t, "extended copy")) {
            int rejected = t && t->status == SCSI_STATUS_CHECK_CONDITION &&
                           t->sense.key == SCSI_SENSE_ILLEGAL_REQUEST;
            printf("xcopy_rejected sense_key %x asc_ascq %04x\n", t ? t->sense.key : 0,
                   t ? t->sense.ascq : 0);
            return rejected ? 3 : 1;
        }
        scsi_free_scsi_task(t);
        commands++;
    }
    double secs = (now_ns() - t0) / 1e9;

    /* spot check: SAMPLES 1 MiB ranges, same offsets on both LUNs */
    int verified = 0;
    uint64_t x = 0x9e3779b97f4a7c15ull, span = 2048;
    for (int i = 0; i < samples && blocks >= span; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        uint64_t at = (x % (blocks - span + 1)) & ~7ull;
        struct scsi_task *r1 = iscsi_read16_sync(c, src, at, span * BS, BS, 0, 0, 0, 0, 0);
        struct scsi_task *r2 = iscsi_read16_sync(c, dst, at, span * BS, BS, 0, 0, 0, 0, 0);
        if (!ok(r1, "read src") || !ok(r2, "read dst")) return 1;
        if (r1->datain.size != r2->datain.size ||
            memcmp(r1->datain.data, r2->datain.data, r1->datain.size) != 0) {
            fprintf(stderr, "copy differs at lba %" PRIu64 "\n", at);
            return 1;
        }
        scsi_free_scsi_task(r1);
        scsi_free_scsi_task(r2);
        verified++;
    }
    printf("xcopy_seconds %.3f commands %d verified %d\n", secs, commands, verified);
    iscsi_logout_sync(c);
    iscsi_destroy_context(c);
    return 0;
}
