/* What an ESXi host does to a VMFS datastore LUN, through libiscsi:
 *
 *   esxi_datastore PORTAL IQN LUN_A LUN_B BIG_MIB DATA_MIB HEARTBEATS
 *
 * While HEARTBEATS other initiators (threads, each its own session and initiator name)
 * beat with COMPARE AND WRITE (ATS) on LUN A — each on its own heartbeat sector, and all on
 * one shared lock sector, retrying on MISCOMPARE like VMFS's lock manager:
 *   1. WRITE SAME(16) of a zero block over BIG_MIB of LUN A in 1 MiB commands, 8 in flight
 *      (eager-zeroing a disk);
 *   2. WRITE(16) of DATA_MIB of distinct data at the start of LUN A;
 *   3. EXTENDED COPY of it in 4 MiB segments, 8 in flight, within LUN A (to offset DATA_MIB)
 *      and across LUNs (LUN A -> LUN B offset 0) (cloning a virtual disk);
 *   4. reads back: both copies equal the source; the zeroed range past the copies reads as
 *      zeros; every heartbeat sector holds its final count and the lock sector the sum.
 * Every command's latency is measured; the program fails if any took over LIMIT_MS (an
 * optional eighth argument, default 1000) — an EXTENDED COPY over COPY_LIMIT_MS (an optional
 * ninth, default LIMIT_MS) — or if any command failed or any data is wrong.
 * Prints one line of figures. Exit 0 on success.
 */
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>

#define BS 512
#define MIB (1024 * 1024)
#ifndef IN_FLIGHT /* commands in flight: cc -DIN_FLIGHT=N (bench/iscsi/esxi-clone.sh --in-flight) */
#define IN_FLIGHT 8
#endif
#define WS_BYTES MIB
#define COPY_BYTES (4 * MIB)
#define LIMIT_US 1000000
#define LOCK_LBA 0           /* heartbeats live in the first MiB, which phase 1 skips */
#define HB_LBA(i) (8 + 8 * (i))
#define RESERVED_MIB 1

static const char *portal, *iqn;
static atomic_int stop_beats;
/* Worst latency per kind of command: WRITE SAME, WRITE, EXTENDED COPY, COMPARE AND WRITE. */
enum kind { K_WS, K_WRITE, K_XCOPY, K_ATS, K_N };
static const char *kind_name[K_N] = { "write_same", "write", "xcopy", "ats" };
static atomic_uint_fast64_t worst_us[K_N];
static atomic_int failures;

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void note_latency(enum kind k, uint64_t us) {
    uint64_t w = atomic_load(&worst_us[k]);
    while (us > w && !atomic_compare_exchange_weak(&worst_us[k], &w, us)) {}
}

static void fail(const char *what, struct scsi_task *t) {
    fprintf(stderr, "%s failed: status %d sense %x/%x/%x\n", what, t ? t->status : -1,
            t ? t->sense.key : 0, t ? t->sense.ascq >> 8 : 0, t ? t->sense.ascq & 0xff : 0);
    atomic_fetch_add(&failures, 1);
}

static struct iscsi_context *login(const char *name, int lun) {
    struct iscsi_context *c = iscsi_create_context(name);
    if (!c) { fprintf(stderr, "no context\n"); exit(2); }
    iscsi_set_targetname(c, iqn);
    iscsi_set_session_type(c, ISCSI_SESSION_NORMAL);
    iscsi_set_header_digest(c, ISCSI_HEADER_DIGEST_NONE_CRC32C);
    if (iscsi_full_connect_sync(c, portal, lun) != 0) {
        fprintf(stderr, "login %s failed: %s\n", name, iscsi_get_error(c));
        exit(2);
    }
    /* A fresh session's first command may meet a unit attention: take it here. */
    struct scsi_task *t = iscsi_testunitready_sync(c, lun);
    if (t) scsi_free_scsi_task(t);
    return c;
}

/* ---------------------------------------------------------------- ATS heartbeats */

struct beater { int id; uint64_t start, beats, retries, lock_incs; };

static uint64_t counter(struct iscsi_context *c, uint64_t lba);

/* One ATS increment of the 8-byte counter at the start of sector `lba`; returns 0 on
 * success, 1 on MISCOMPARE (someone else changed it first), -1 on error. */
static int ats_increment(struct iscsi_context *c, int lun, uint64_t lba) {
    unsigned char buf[2 * BS];
    struct scsi_task *t = iscsi_read16_sync(c, lun, lba, BS, BS, 0, 0, 0, 0, 0);
    if (!t || t->status != SCSI_STATUS_GOOD) { fail("heartbeat read", t); if (t) scsi_free_scsi_task(t); return -1; }
    memcpy(buf, t->datain.data, BS);
    scsi_free_scsi_task(t);
    memcpy(buf + BS, buf, BS);
    uint64_t v;
    memcpy(&v, buf, 8);
    v++;
    memcpy(buf + BS, &v, 8);
    uint64_t t0 = now_us();
    t = iscsi_compareandwrite_sync(c, lun, lba, buf, 2 * BS, BS, 0, 0, 0, 0, 0);
    note_latency(K_ATS, now_us() - t0);
    int r;
    if (t && t->status == SCSI_STATUS_CHECK_CONDITION && t->sense.key == SCSI_SENSE_MISCOMPARE) r = 1;
    else if (t && t->status == SCSI_STATUS_GOOD) r = 0;
    else { fail("compare and write", t); r = -1; }
    if (t) scsi_free_scsi_task(t);
    return r;
}

static void *beat(void *arg) {
    struct beater *b = arg;
    char name[96];
    snprintf(name, sizeof name, "iqn.2026-11.org.ibid:esxi-host-%d", b->id);
    struct iscsi_context *c = login(name, 0);
    b->start = counter(c, HB_LBA(b->id));
    while (!atomic_load(&stop_beats) && !atomic_load(&failures)) {
        if (ats_increment(c, 0, HB_LBA(b->id)) != 0) break;
        b->beats++;
        for (;;) {
            int r = ats_increment(c, 0, LOCK_LBA);
            if (r < 0) goto out;
            if (r == 0) { b->lock_incs++; break; }
            b->retries++;
        }
        struct timespec pause = { 0, 2 * 1000 * 1000 };
        nanosleep(&pause, NULL);
    }
out:
    iscsi_logout_sync(c);
    iscsi_destroy_context(c);
    return NULL;
}

/* ---------------------------------------------------------------- commands in flight */

struct slot { int busy; uint64_t started; const char *what; enum kind kind; };
struct flight { struct iscsi_context *c; struct slot slots[IN_FLIGHT]; int busy; };

static void done(struct iscsi_context *c, int status, void *command_data, void *private_data) {
    (void)c; (void)status;
    struct slot *s = private_data;
    struct scsi_task *t = command_data;
    note_latency(s->kind, now_us() - s->started);
    if (!t || t->status != SCSI_STATUS_GOOD) fail(s->what, t);
    if (t) scsi_free_scsi_task(t);
    s->busy = 0;
}

/* Serves the connection until fewer than `max_busy` commands are in flight. */
static void wait_below(struct flight *f, int max_busy) {
    for (;;) {
        int busy = 0;
        for (int i = 0; i < IN_FLIGHT; i++) busy += f->slots[i].busy;
        if (busy < max_busy) return;
        struct pollfd pfd = { iscsi_get_fd(f->c), (short)iscsi_which_events(f->c), 0 };
        if (poll(&pfd, 1, 5000) < 0 || iscsi_service(f->c, pfd.revents) < 0) {
            fprintf(stderr, "connection failed: %s\n", iscsi_get_error(f->c));
            exit(1);
        }
    }
}

static struct slot *free_slot(struct flight *f, const char *what, enum kind kind) {
    wait_below(f, IN_FLIGHT);
    for (int i = 0; i < IN_FLIGHT; i++) {
        if (!f->slots[i].busy) {
            f->slots[i].busy = 1;
            f->slots[i].started = now_us();
            f->slots[i].what = what;
            f->slots[i].kind = kind;
            return &f->slots[i];
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- EXTENDED COPY */

static int naa_of(struct iscsi_context *c, int lun, unsigned char out[16]) {
    struct scsi_task *t = iscsi_inquiry_sync(c, lun, 1, 0x83, 255);
    if (!t || t->status != SCSI_STATUS_GOOD) { fail("inquiry 83h", t); return 0; }
    unsigned char *d = t->datain.data;
    int len = (d[2] << 8 | d[3]) + 4, found = 0;
    for (int p = 4; p + 4 <= len && p + 4 <= t->datain.size; p += 4 + d[p + 3]) {
        if ((d[p + 1] & 0x0f) == 3 && (d[p + 1] & 0x30) == 0 && d[p + 3] == 16) {
            memcpy(out, d + p + 4, 16);
            found = 1;
            break;
        }
    }
    scsi_free_scsi_task(t);
    return found;
}

struct xcopy_param { unsigned char p[16 + 64 + 28]; struct iscsi_data data; };

static void put_be64(unsigned char *d, uint64_t v) {
    for (int i = 0; i < 8; i++) d[i] = v >> (56 - 8 * i);
}

/* One EXTENDED COPY parameter list: one segment of `blocks` from src to dst. */
static void xcopy_list(struct xcopy_param *x, const unsigned char src[16], const unsigned char dst[16],
                       uint64_t src_lba, uint64_t dst_lba, int blocks) {
    unsigned char *p = x->p;
    memset(p, 0, sizeof x->p);
    p[1] = 3 << 3;          /* LIST ID USAGE 11b: no list id */
    p[3] = 64;              /* target descriptor list length */
    p[11] = 28;             /* segment descriptor list length */
    for (int i = 0; i < 2; i++) {
        unsigned char *d = p + 16 + 32 * i;
        d[0] = 0xe4;
        d[4] = 0x01;
        d[5] = 0x03;
        d[7] = 16;
        memcpy(d + 8, i ? dst : src, 16);
        d[30] = BS >> 8;
    }
    unsigned char *s = p + 80;
    s[0] = 0x02;
    s[3] = 24;
    s[5] = 0;
    s[7] = 1;
    s[10] = blocks >> 8;
    s[11] = blocks & 0xff;
    put_be64(s + 12, src_lba);
    put_be64(s + 20, dst_lba);
    x->data.size = sizeof x->p;
    x->data.data = p;
}

static int same(struct iscsi_context *c, int lun, uint64_t off, const unsigned char *want, uint64_t len) {
    for (uint64_t done_b = 0; done_b < len; done_b += MIB) {
        struct scsi_task *t = iscsi_read16_sync(c, lun, (off + done_b) / BS, MIB, BS, 0, 0, 0, 0, 0);
        if (!t || t->status != SCSI_STATUS_GOOD) { fail("read16", t); return 0; }
        int ok = want ? memcmp(t->datain.data, want + done_b, MIB) == 0 : 1;
        if (!want) for (int i = 0; i < MIB && ok; i++) ok = t->datain.data[i] == 0;
        scsi_free_scsi_task(t);
        if (!ok) {
            fprintf(stderr, "LUN %d: wrong data in the MiB at %" PRIu64 "\n", lun, off + done_b);
            return 0;
        }
    }
    return 1;
}

static uint64_t counter(struct iscsi_context *c, uint64_t lba) {
    struct scsi_task *t = iscsi_read16_sync(c, 0, lba, BS, BS, 0, 0, 0, 0, 0);
    uint64_t v = 0;
    if (t && t->status == SCSI_STATUS_GOOD) memcpy(&v, t->datain.data, 8);
    else fail("read counter", t);
    if (t) scsi_free_scsi_task(t);
    return v;
}

int main(int argc, char **argv) {
    if (argc < 8) { fprintf(stderr, "usage: see the comment at the top\n"); return 2; }
    portal = argv[1];
    iqn = argv[2];
    int lun_a = atoi(argv[3]), lun_b = atoi(argv[4]);
    uint64_t big = strtoull(argv[5], NULL, 10) * MIB, data_len = strtoull(argv[6], NULL, 10) * MIB;
    int nbeat = atoi(argv[7]);
    uint64_t limit_us = argc > 8 ? strtoull(argv[8], NULL, 10) * 1000 : LIMIT_US;
    uint64_t copy_limit_us = argc > 9 ? strtoull(argv[9], NULL, 10) * 1000 : limit_us;
    if (lun_a != 0 || data_len % COPY_BYTES || big < RESERVED_MIB * MIB + 2 * data_len + 4 * MIB) {
        fprintf(stderr, "LUN_A must be 0, DATA_MIB a multiple of 4 and BIG_MIB >= 5 + 2 * DATA_MIB\n");
        return 2;
    }
    struct iscsi_context *first = login("iqn.2026-11.org.ibid:esxi-host-main", lun_a);
    uint64_t lock_start = counter(first, LOCK_LBA);
    pthread_t th[64];
    struct beater b[64];
    if (nbeat > 64) nbeat = 64;
    for (int i = 0; i < nbeat; i++) {
        b[i] = (struct beater){ .id = i };
        pthread_create(&th[i], NULL, beat, &b[i]);
    }
    struct flight f = { .c = first };

    /* 1. Eager-zero: WRITE SAME of a zero block, 1 MiB per command, 8 in flight. */
    unsigned char zero[BS];
    memset(zero, 0, sizeof zero);
    uint64_t t0 = now_us(), ws = 0;
    for (uint64_t off = RESERVED_MIB * MIB; off < big; off += WS_BYTES, ws++) {
        struct slot *s = free_slot(&f, "write same", K_WS);
        if (!iscsi_writesame16_task(f.c, lun_a, off / BS, zero, BS, WS_BYTES / BS, 0, 0, 0, 0, done, s)) {
            fprintf(stderr, "write same not sent\n");
            return 1;
        }
    }
    wait_below(&f, 1);
    uint64_t ws_us = now_us() - t0;

    /* 2. Data: distinct in every 512-byte block. */
    unsigned char *src = malloc(data_len);
    for (uint64_t i = 0; i < data_len / 8; i++) ((uint64_t *)src)[i] = i * 0x9e3779b97f4a7c15ull + 1;
    uint64_t data_off = RESERVED_MIB * MIB;
    for (uint64_t off = 0; off < data_len; off += MIB) {
        struct slot *s = free_slot(&f, "write16", K_WRITE);
        if (!iscsi_write16_task(f.c, lun_a, (data_off + off) / BS, src + off, MIB, BS, 0, 0, 0, 0, 0, done, s)) {
            fprintf(stderr, "write not sent\n");
            return 1;
        }
    }
    wait_below(&f, 1);

    /* ESXI_SETTLE_MS (environment): a pause before the copies, so that they meet data the
     * target has had time to commit (a clone of a disk written long before). */
    const char *settle = getenv("ESXI_SETTLE_MS");
    if (settle) {
        long ms = atol(settle);
        struct timespec pause = { ms / 1000, (ms % 1000) * 1000000L };
        nanosleep(&pause, NULL);
    }

    /* 3. EXTENDED COPY in 4 MiB segments, 8 in flight: within LUN A, then A -> B. */
    unsigned char naa_a[16], naa_b[16];
    if (!naa_of(f.c, lun_a, naa_a) || !naa_of(f.c, lun_b, naa_b)) return 1;
    struct xcopy_param xp[IN_FLIGHT];
    uint64_t within_off = data_off + data_len;
    t0 = now_us();
    uint64_t nx = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (uint64_t off = 0; off < data_len; off += COPY_BYTES, nx++) {
            struct slot *s = free_slot(&f, "extended copy", K_XCOPY);
            struct xcopy_param *x = &xp[s - f.slots];
            uint64_t dst = pass == 0 ? within_off + off : off;
            xcopy_list(x, naa_a, pass == 0 ? naa_a : naa_b, (data_off + off) / BS, dst / BS, COPY_BYTES / BS);
            if (!iscsi_extended_copy_task(f.c, lun_a, &x->data, done, s)) {
                fprintf(stderr, "extended copy not sent\n");
                return 1;
            }
        }
    }
    wait_below(&f, 1);
    uint64_t xc_us = now_us() - t0;

    atomic_store(&stop_beats, 1);
    uint64_t beats = 0, retries = 0, lock_incs = 0;
    for (int i = 0; i < nbeat; i++) {
        pthread_join(th[i], NULL);
        beats += b[i].beats;
        retries += b[i].retries;
        lock_incs += b[i].lock_incs;
    }

    /* 4. Check. */
    int ok = same(f.c, lun_a, data_off, src, data_len)
        && same(f.c, lun_a, within_off, src, data_len)
        && same(f.c, lun_b, 0, src, data_len)
        && same(f.c, lun_a, within_off + data_len, NULL, 4 * MIB);
    for (int i = 0; i < nbeat && ok; i++) {
        uint64_t v = counter(f.c, HB_LBA(i));
        if (v != b[i].start + b[i].beats) {
            fprintf(stderr, "heartbeat %d: %" PRIu64 " on disk, %" PRIu64 " + %" PRIu64 " beats\n", i, v, b[i].start, b[i].beats);
            ok = 0;
        }
    }
    if (ok && counter(f.c, LOCK_LBA) != lock_start + lock_incs) {
        fprintf(stderr, "lock sector: %" PRIu64 ", %" PRIu64 " + %" PRIu64 " increments: an update was lost\n",
                counter(f.c, LOCK_LBA), lock_start, lock_incs);
        ok = 0;
    }
    iscsi_logout_sync(f.c);
    iscsi_destroy_context(f.c);
    printf("write_same_cmds %" PRIu64 " write_same_s %.3f xcopy_cmds %" PRIu64 " xcopy_s %.3f "
           "heartbeats %" PRIu64 " lock_increments %" PRIu64 " lock_retries %" PRIu64,
           ws, ws_us / 1e6, nx, xc_us / 1e6, beats, lock_incs, retries);
    int slow = 0;
    for (int k = 0; k < K_N; k++) {
        uint64_t w = atomic_load(&worst_us[k]);
        uint64_t limit = k == K_XCOPY ? copy_limit_us : limit_us;
        printf(" worst_%s_ms %.1f", kind_name[k], w / 1e3);
        if (w > limit) {
            fprintf(stderr, "a %s command took %.1f ms (limit %.0f ms)\n", kind_name[k], w / 1e3, limit / 1e3);
            slow = 1;
        }
    }
    printf("\n");
    if (atomic_load(&failures)) { fprintf(stderr, "%d commands failed\n", atomic_load(&failures)); return 1; }
    if (!ok) return 1;
    if (slow) return 1;
    if (nbeat > 0 && beats == 0) { fprintf(stderr, "no heartbeat completed\n"); return 1; }
    return 0;
}
