/* A small libiscsi initiator for ibid-iscsi's tests.
 *
 *   ibid_initiator xcopy  PORTAL IQN
 *       EXTENDED COPY LUN 0 -> LUN 1 and LUN 0 -> LUN 0, verified by reads.
 *   ibid_initiator caw    PORTAL IQN ITERATIONS NAME
 *       Increment a counter in LBA 0 of LUN 0 ITERATIONS times with
 *       COMPARE AND WRITE (retrying on MISCOMPARE); prints each latency (us).
 *   ibid_initiator digest PORTAL IQN
 *       Log in with CRC32C header digests, write and read back.
 *   ibid_initiator chap   PORTAL IQN USER PASS [TUSER TPASS]
 *       Log in with (mutual) CHAP, then TEST UNIT READY.
 *   ibid_initiator pr-set   PORTAL IQN LUN
 *       As initiator pr-a: REGISTER key 0xa1 with APTPL, RESERVE Write Exclusive;
 *       checks REPORT CAPABILITIES (PTPL_C, PTPL_A) and READ KEYS.
 *   ibid_initiator pr-check PORTAL IQN LUN
 *       As initiator pr-b (a new session, after a target restart): key 0xa1 is still
 *       registered and holds Write Exclusive, so pr-b's WRITE conflicts and its READ does
 *       not; then pr-b registers, preempts 0xa1, writes, and clears everything.
 *   ibid_initiator ua-wait  PORTAL IQN LUN
 *       Log in, TEST UNIT READY LUN until it is GOOD, print "ready", wait for a line on
 *       stdin (the test changes the LUN inventory meanwhile), then TEST UNIT READY again:
 *       it must be UNIT ATTENTION / REPORTED LUNS DATA HAS CHANGED (3Fh/0Eh).
 * Exit status 0 on success; messages on stderr.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>

#define BS 512
#define COPY_BLOCKS 2048

static struct iscsi_context *login(const char *portal, const char *iqn,
                                   const char *name, int lun) {
    struct iscsi_context *c = iscsi_create_context(name);
    if (!c) { fprintf(stderr, "no context\n"); exit(2); }
    iscsi_set_targetname(c, iqn);
    iscsi_set_session_type(c, ISCSI_SESSION_NORMAL);
    iscsi_set_header_digest(c, ISCSI_HEADER_DIGEST_NONE_CRC32C);
    if (iscsi_full_connect_sync(c, portal, lun) != 0) {
        fprintf(stderr, "login failed: %s\n", iscsi_get_error(c));
        exit(2);
    }
    return c;
}

static int ok(struct scsi_task *t, const char *what) {
    if (t == NULL || t->status != SCSI_STATUS_GOOD) {
        fprintf(stderr, "%s failed: status %d sense %x/%x\n", what,
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
    for (int p = 4; p + 4 <= len; p += 4 + d[p + 3]) {
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

static void seg_desc(unsigned char *d, int src, int dst, int blocks,
                     uint64_t src_lba, uint64_t dst_lba) {
    memset(d, 0, 28);
    d[0] = 0x02;           /* block -> block */
    d[3] = 24;
    d[5] = src;
    d[7] = dst;
    d[10] = blocks >> 8;
    d[11] = blocks & 0xff;
    for (int i = 0; i < 8; i++) {
        d[12 + i] = src_lba >> (56 - 8 * i);
        d[20 + i] = dst_lba >> (56 - 8 * i);
    }
}

static int xcopy(struct iscsi_context *c, const unsigned char a[16],
                 const unsigned char b[16], uint64_t src_lba, uint64_t dst_lba) {
    unsigned char p[16 + 64 + 28];
    memset(p, 0, sizeof p);
    p[1] = 3 << 3;         /* LIST ID USAGE: none */
    p[3] = 64;
    p[11] = 28;
    target_desc(p + 16, a);
    target_desc(p + 48, b);
    seg_desc(p + 80, 0, 1, COPY_BLOCKS, src_lba, dst_lba);
    struct iscsi_data data = { sizeof p, p };
    struct scsi_task *t = iscsi_extended_copy_sync(c, 0, &data);
    int r = ok(t, "extended copy");
    if (t) scsi_free_scsi_task(t);
    return r;
}

static int verify(struct iscsi_context *c, int lun, uint64_t lba, const unsigned char *want) {
    struct scsi_task *t = iscsi_read16_sync(c, lun, lba, COPY_BLOCKS * BS, BS, 0, 0, 0, 0, 0);
    if (!ok(t, "read16")) return 0;
    int same = t->datain.size == COPY_BLOCKS * BS && memcmp(t->datain.data, want, COPY_BLOCKS * BS) == 0;
    scsi_free_scsi_task(t);
    if (!same) fprintf(stderr, "data mismatch at lun %d lba %" PRIu64 "\n", lun, lba);
    return same;
}

static int cmd_xcopy(const char *portal, const char *iqn) {
    struct iscsi_context *c = login(portal, iqn, "iqn.2026-11.org.ibid:xcopy", 0);
    unsigned char naa0[16], naa1[16];
    if (!naa_of(c, 0, naa0) || !naa_of(c, 1, naa1)) { fprintf(stderr, "no NAA\n"); return 1; }
    unsigned char *buf = malloc(COPY_BLOCKS * BS);
    for (int i = 0; i < COPY_BLOCKS * BS; i++) buf[i] = (unsigned char)(i * 7 + i / BS);
    struct scsi_task *t = iscsi_write16_sync(c, 0, 0, buf, COPY_BLOCKS * BS, BS, 0, 0, 0, 0, 0);
    if (!ok(t, "write16")) return 1;
    scsi_free_scsi_task(t);
    if (!xcopy(c, naa0, naa1, 0, 4096) || !verify(c, 1, 4096, buf)) return 1;
    if (!xcopy(c, naa0, naa0, 0, 8192) || !verify(c, 0, 8192, buf)) return 1;
    iscsi_logout_sync(c);
    iscsi_destroy_context(c);
    printf("xcopy ok\n");
    return 0;
}

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int cmd_caw(const char *portal, const char *iqn, int iters, const char *name) {
    struct iscsi_context *c = login(portal, iqn, name, 0);
    unsigned char buf[2 * BS];
    for (int done = 0; done < iters;) {
        struct scsi_task *t = iscsi_read16_sync(c, 0, 0, BS, BS, 0, 0, 0, 0, 0);
        if (!ok(t, "read16")) return 1;
        memcpy(buf, t->datain.data, BS);
        scsi_free_scsi_task(t);
        uint64_t v;
        memcpy(&v, buf, 8);
        memcpy(buf + BS, buf, BS);
        v++;
        memcpy(buf + BS, &v, 8);
        uint64_t t0 = now_us();
        t = iscsi_compareandwrite_sync(c, 0, 0, buf, 2 * BS, BS, 0, 0, 0, 0, 0);
        uint64_t dt = now_us() - t0;
        if (t && t->status == SCSI_STATUS_CHECK_CONDITION && t->sense.key == SCSI_SENSE_MISCOMPARE) {
            printf("miscompare %" PRIu64 "\n", dt);
        } else if (ok(t, "compare and write")) {
            printf("latency %" PRIu64 "\n", dt);
            done++;
        } else {
            return 1;
        }
        if (t) scsi_free_scsi_task(t);
    }
    iscsi_logout_sync(c);
    iscsi_destroy_context(c);
    return 0;
}

static int cmd_digest(const char *portal, const char *iqn) {
    struct iscsi_context *c = iscsi_create_context("iqn.2026-11.org.ibid:digest");
    iscsi_set_targetname(c, iqn);
    iscsi_set_session_type(c, ISCSI_SESSION_NORMAL);
    iscsi_set_header_digest(c, ISCSI_HEADER_DIGEST_CRC32C);
    if (iscsi_full_connect_sync(c, portal, 0) != 0) {
        fprintf(stderr, "login failed: %s\n", iscsi_get_error(c));
        return 1;
    }
    unsigned char buf[64 * BS];
    for (unsigned i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)(i ^ 0x5a);
    struct scsi_task *t = iscsi_write16_sync(c, 0, 100, buf, sizeof buf, BS, 0, 0, 0, 0, 0);
    if (!ok(t, "write16")) return 1;
    t = iscsi_read16_sync(c, 0, 100, sizeof buf, BS, 0, 0, 0, 0, 0);
    if (!ok(t, "read16") || memcmp(t->datain.data, buf, sizeof buf) != 0) return 1;
    iscsi_logout_sync(c);
    printf("digest ok\n");
    return 0;
}

static int cmd_chap(const char *portal, const char *iqn, const char *user, const char *pass,
                    const char *tuser, const char *tpass) {
    struct iscsi_context *c = iscsi_create_context("iqn.2026-11.org.ibid:chap");
    iscsi_set_targetname(c, iqn);
    iscsi_set_session_type(c, ISCSI_SESSION_NORMAL);
    iscsi_set_initiator_username_pwd(c, user, pass);
    if (tuser) iscsi_set_target_username_pwd(c, tuser, tpass);
    if (iscsi_full_connect_sync(c, portal, 0) != 0) {
        fprintf(stderr, "login failed: %s\n", iscsi_get_error(c));
        return 1;
    }
    struct scsi_task *t = iscsi_testunitready_sync(c, 0);
    if (!ok(t, "test unit ready")) return 1;
    iscsi_logout_sync(c);
    printf("chap ok\n");
    return 0;
}

#define PR_KEY_A 0xa1
#define PR_KEY_B 0xb2

static struct scsi_task *prout(struct iscsi_context *c, int lun, int sa, int type,
                               uint64_t key, uint64_t sa_key, int aptpl) {
    struct scsi_persistent_reserve_out_basic p;
    memset(&p, 0, sizeof p);
    p.reservation_key = key;
    p.service_action_reservation_key = sa_key;
    p.aptpl = aptpl;
    return iscsi_persistent_reserve_out_sync(c, lun, sa, 0, type, &p);
}

/* Whether READ KEYS lists `key`; -1 on error. */
static int has_key(struct iscsi_context *c, int lun, uint64_t key) {
    struct scsi_task *t = iscsi_persistent_reserve_in_sync(c, lun, SCSI_PERSISTENT_RESERVE_READ_KEYS, 255);
    if (!ok(t, "read keys")) return -1;
    struct scsi_persistent_reserve_in_read_keys *k = scsi_datain_unmarshall(t);
    int found = 0;
    for (int i = 0; k && i < k->num_keys; i++) found |= k->keys[i] == key;
    scsi_free_scsi_task(t);
    return found;
}

static int cmd_pr_set(const char *portal, const char *iqn, int lun) {
    struct iscsi_context *c = login(portal, iqn, "iqn.2026-11.org.ibid:pr-a", lun);
    struct scsi_task *t = prout(c, lun, SCSI_PERSISTENT_RESERVE_REGISTER_AND_IGNORE_EXISTING_KEY, 0, 0, PR_KEY_A, 1);
    if (!ok(t, "register with APTPL")) return 1;
    scsi_free_scsi_task(t);
    t = prout(c, lun, SCSI_PERSISTENT_RESERVE_RESERVE, SCSI_PERSISTENT_RESERVE_TYPE_WRITE_EXCLUSIVE, PR_KEY_A, 0, 0);
    if (!ok(t, "reserve")) return 1;
    scsi_free_scsi_task(t);
    t = iscsi_persistent_reserve_in_sync(c, lun, SCSI_PERSISTENT_RESERVE_REPORT_CAPABILITIES, 8);
    if (!ok(t, "report capabilities")) return 1;
    /* SPC-4 6.15.4: PTPL_C is bit 0 of byte 2, PTPL_A bit 0 of byte 3. */
    unsigned char *caps = t->datain.data;
    if (t->datain.size < 8 || !(caps[2] & 1) || !(caps[3] & 1)) {
        fprintf(stderr, "capabilities %02x %02x: want PTPL_C and PTPL_A\n",
                t->datain.size >= 4 ? caps[2] : 0, t->datain.size >= 4 ? caps[3] : 0);
        return 1;
    }
    scsi_free_scsi_task(t);
    if (has_key(c, lun, PR_KEY_A) != 1) { fprintf(stderr, "key not registered\n"); return 1; }
    iscsi_logout_sync(c);
    iscsi_destroy_context(c);
    printf("pr-set ok\n");
    return 0;
}

static int cmd_pr_check(const char *portal, const char *iqn, int lun) {
    struct iscsi_context *c = login(portal, iqn, "iqn.2026-11.org.ibid:pr-b", lun);
    unsigned char buf[BS];
    memset(buf, 0x3c, sizeof buf);
    /* The restart's unit attention (if any) is consumed by the first command. */
    struct scsi_task *t = iscsi_testunitready_sync(c, lun);
    if (t) scsi_free_scsi_task(t);
    if (has_key(c, lun, PR_KEY_A) != 1) { fprintf(stderr, "key 0xa1 lost across the restart\n"); return 1; }
    t = iscsi_persistent_reserve_in_sync(c, lun, SCSI_PERSISTENT_RESERVE_READ_RESERVATION, 255);
    if (!ok(t, "read reservation")) return 1;
    struct scsi_persistent_reserve_in_read_reservation *r = scsi_datain_unmarshall(t);
    if (!r || !r->reserved || r->reservation_key != PR_KEY_A || r->pr_type != SCSI_PERSISTENT_RESERVE_TYPE_WRITE_EXCLUSIVE) {
        fprintf(stderr, "reservation lost across the restart\n");
        return 1;
    }
    scsi_free_scsi_task(t);
    t = iscsi_write10_sync(c, lun, 0, buf, BS, BS, 0, 0, 0, 0, 0);
    if (!t || t->status != SCSI_STATUS_RESERVATION_CONFLICT) {
        fprintf(stderr, "write by a non-holder: status %d, want RESERVATION CONFLICT\n", t ? t->status : -1);
        return 1;
    }
    scsi_free_scsi_task(t);
    t = iscsi_read10_sync(c, lun, 0, BS, BS, 0, 0, 0, 0, 0);
    if (!ok(t, "read by a non-holder")) return 1;
    scsi_free_scsi_task(t);
    t = prout(c, lun, SCSI_PERSISTENT_RESERVE_REGISTER_AND_IGNORE_EXISTING_KEY, 0, 0, PR_KEY_B, 1);
    if (!ok(t, "register b")) return 1;
    scsi_free_scsi_task(t);
    t = prout(c, lun, SCSI_PERSISTENT_RESERVE_PREEMPT, SCSI_PERSISTENT_RESERVE_TYPE_WRITE_EXCLUSIVE, PR_KEY_B, PR_KEY_A, 1);
    if (!ok(t, "preempt a")) return 1;
    scsi_free_scsi_task(t);
    if (has_key(c, lun, PR_KEY_A) != 0) { fprintf(stderr, "0xa1 still registered\n"); return 1; }
    t = iscsi_write10_sync(c, lun, 0, buf, BS, BS, 0, 0, 0, 0, 0);
    if (!ok(t, "write by the new holder")) return 1;
    scsi_free_scsi_task(t);
    t = prout(c, lun, SCSI_PERSISTENT_RESERVE_CLEAR, 0, PR_KEY_B, 0, 0);
    if (!ok(t, "clear")) return 1;
    scsi_free_scsi_task(t);
    iscsi_logout_sync(c);
    iscsi_destroy_context(c);
    printf("pr-check ok\n");
    return 0;
}

static int cmd_ua_wait(const char *portal, const char *iqn, int lun) {
    struct iscsi_context *c = login(portal, iqn, "iqn.2026-11.org.ibid:ua", lun);
    for (int i = 0; i < 10; i++) {
        struct scsi_task *t = iscsi_testunitready_sync(c, lun);
        int good = t && t->status == SCSI_STATUS_GOOD;
        if (t) scsi_free_scsi_task(t);
        if (good) break;
    }
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    struct scsi_task *t = iscsi_testunitready_sync(c, lun);
    if (!t || t->status != SCSI_STATUS_CHECK_CONDITION || t->sense.key != SCSI_SENSE_UNIT_ATTENTION
        || t->sense.ascq != 0x3f0e) {
        fprintf(stderr, "TEST UNIT READY: status %d sense %x/%04x, want UNIT ATTENTION 3F/0E\n",
                t ? t->status : -1, t ? t->sense.key : 0, t ? t->sense.ascq : 0);
        return 1;
    }
    scsi_free_scsi_task(t);
    t = iscsi_testunitready_sync(c, lun);
    if (!ok(t, "test unit ready after the unit attention")) return 1;
    iscsi_logout_sync(c);
    printf("ua ok\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && !strcmp(argv[1], "xcopy")) return cmd_xcopy(argv[2], argv[3]);
    if (argc >= 6 && !strcmp(argv[1], "caw")) return cmd_caw(argv[2], argv[3], atoi(argv[4]), argv[5]);
    if (argc >= 4 && !strcmp(argv[1], "digest")) return cmd_digest(argv[2], argv[3]);
    if (argc >= 6 && !strcmp(argv[1], "chap"))
        return cmd_chap(argv[2], argv[3], argv[4], argv[5], argc >= 8 ? argv[6] : NULL, argc >= 8 ? argv[7] : NULL);
    if (argc >= 5 && !strcmp(argv[1], "ua-wait")) return cmd_ua_wait(argv[2], argv[3], atoi(argv[4]));
    if (argc >= 5 && !strcmp(argv[1], "pr-set")) return cmd_pr_set(argv[2], argv[3], atoi(argv[4]));
    if (argc >= 5 && !strcmp(argv[1], "pr-check")) return cmd_pr_check(argv[2], argv[3], atoi(argv[4]));
    fprintf(stderr, "usage: see the comment at the top of ibid_initiator.c\n");
    return 2;
}
