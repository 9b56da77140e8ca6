/*
 * test-conn-rx.c: the receiver's side of the per-buffer fast path across
 * processes (src/conn/rx.c): gpuipc_conn_recv and recv_batch, release and
 * release_batch, get_outstanding, their argument checks, the order of a
 * producer's reuse after a consumer's release, and the refusal of forged
 * CHUNK/CTL/BUF/BUFS/BUFW frames.
 *
 * The ordering tests need the emulator's GPUIPC_EMU_COPY_DELAY_US (slow
 * copies make a missing wait visible); on a real GPU they run with large
 * copies instead, which the consumer would otherwise overtake.
 */
#include "test-conn-handoff.h"

#include <unistd.h>

/* ---- argument checks ----------------------------------------------------------------- */

TEST_IMPL(handoff_api_checks) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_consumer", NULL, &fd, "pair", "0", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_STATUS(gpuipc_arena_alloc(a, 0, NULL, &b), GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_arena_alloc(a, 100, (struct CUstream_st *)s, &b));
  ASSERT_EQ(gpuipc_block_get_size(b), 100);
  uint8_t meta[GPUIPC_META_MAX + 1] = {0};
  ASSERT_STATUS(gpuipc_conn_send(c, b, NULL, meta, sizeof meta),
                GPUIPC_E_INVALID_ARG);
  /* Destroying an arena with blocks out is refused. */
  ASSERT_STATUS(gpuipc_arena_destroy(a), GPUIPC_E_BUSY);
  /* A release of something never received. */
  ASSERT_STATUS(gpuipc_conn_release(c, 12345, NULL), GPUIPC_E_NOT_FOUND);
  /* recv with nothing coming times out, or would block. */
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_set_timeout(c, 100));
  ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &r), GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
  /* A miss replaces the message before it, and one formatted on top of
   * it reads it (it is kept unformatted until asked). */
  for (int i = 0; i < 3; i++) {
    ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &r), GPUIPC_E_WOULD_BLOCK);
    if (i < 2)
      ASSERT_STR_EQ(gpuipc_last_error(), "receive would block");
    ASSERT_EQ(gpuipc_last_cuda_error(), 0);
    ASSERT_EQ(gpuipc_last_errno(), 0);
  }
  ASSERT_STATUS(gpuipc_conn_release(c, 12345, NULL), GPUIPC_E_NOT_FOUND);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "is not held");
  gpuipc_received small = GPUIPC_RECEIVED_INIT;
  small.size = 8;
  ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &small), GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 0));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 30000));
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  ASSERT_OK(gpuipc_arena_destroy(NULL));
  return 0;
}

/* ---- ordering: reuse after a release ------------------------------------------------- */

TEST_IMPL(handoff_order_reuse_after_release) {
  REQUIRE_DEVICES(1);
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)256 << 20;
  int fd;
  /* The consumer's copy out of the buffer is slow; the producer overwrites
   * the memory as soon as the release arrives. */
  pid_t pid = spawn_helper("ho_order", harness_on_emulator() ? delay_env : NULL,
                           &fd, "reuse", NULL);
  gpuipc_conn *c = pair_conn(fd);
  /* Room for the connection's flag words (4 KiB) and one block: the reuse
   * below must get the same memory back. */
  gpuipc_arena *a = mkarena(n + 8192);
  CUstream s = mkstream();
  warm_up(c, a, s);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  void *first = gpuipc_block_get_ptr(b);
  uint8_t *host = malloc(n);
  pattern(host, n, 99);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)first, host, n, s));
  uint32_t seed = 99;
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 8);
  /* The release has arrived (it came before the message). Reuse: the same
   * memory comes back, ordered on s after the consumer's queued copy. */
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  gpuipc_block *b2 = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b2));
  ASSERT_PTR_EQ(gpuipc_block_get_ptr(b2), first);
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)first, 0x55, n, s));
  /* Not synchronized: the overwrite may still be queued behind the wait. */
  ASSERT_OK(gpuipc_conn_send_msg(c, "overwritten", 11, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint8_t probe[16];
  d2h(probe, first, sizeof probe);
  ASSERT_EQ(probe[0], 0x55);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  free(host);
  ASSERT_OK(gpuipc_block_free(b2, (struct CUstream_st *)s));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- hostile fast-path frames -------------------------------------------------------- */

/* Completes the handshake, optionally sends one real block (so the chunk
 * and the flag words are known), then forges a frame: argv[0] names it. */
HELPER_IMPL(ho_forger) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  const char *what = argv[0];
  gpuipc__w_buf w = {1, 1, 0, 256, 0, 0, GPUIPC__BUF_ORDERED, 0};
  if ((strncmp(what, "buf_", 4) == 0 && strcmp(what, "buf_before_ctl") != 0) ||
      strncmp(what, "bufs_", 5) == 0 || strncmp(what, "bufw_", 5) == 0) {
    /* Kept until exit (the victim hangs up holding the block). */
    static gpuipc_arena *a;
    static gpuipc_block *b;
    a = mkarena((size_t)1 << 20);
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
    ASSERT_OK(gpuipc_conn_send(c, b, NULL, NULL, 0));
    ASSERT_OK(gpuipc_conn_progress(c, 0));
    /* Arena ids count from 1 in each process: 1 is the helper's arena, 2
     * the flag-word arena made by the first send. The consumer imported
     * chunk 0 of both; the forged frames name the second (1 MiB). */
    w.arena_id = 2;
    w.seq = 100;
    w.slot = 1;
  }
  int fd = gpuipc_conn_get_fd(c);
  if (strcmp(what, "buf_before_ctl") == 0) {
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "rel_unheld") == 0) {
    gpuipc__w_rel r = {7, 3, 0};
    raw_frame(fd, GPUIPC__F_REL, &r, sizeof r);
  } else if (strcmp(what, "chunk_garbage") == 0) {
    unsigned char p[24 + 64];
    gpuipc__w_chunk ch = {9, 4096, 0, 64};
    memcpy(p, &ch, sizeof ch);
    memset(p + sizeof ch, 0xAB, 64);
    raw_frame(fd, GPUIPC__F_CHUNK, p, sizeof p);
  } else if (strcmp(what, "buf_out_of_range") == 0) {
    w.off = (uint64_t)64 << 20; /* the chunk has 2 MiB */
    w.len = 4096;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_slot") == 0) {
    w.slot = 1u << 20;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_meta_len") == 0) {
    w.meta_len = 200;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_done_unordered") == 0) {
    w.flags = GPUIPC__BUF_DONE;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_unknown_chunk") == 0) {
    w.chunk = 5;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_seq_past_limit") == 0) {
    /* More than 2^63 past the first buffer's sequence number: the GPU's
     * cyclic comparison would order the two backwards, and the write that
     * unblocks our streams at close (the newest value) would never satisfy
     * the first buffer's wait. */
    w.seq = GPUIPC__SEQ_LIMIT + ((uint64_t)1 << 63);
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strncmp(what, "bufw_", 5) == 0) {
    /* A buffer ordered by a "broadcast word" in the flag-word chunk. */
    struct {
      gpuipc__w_buf b;
      gpuipc__w_word w;
    } f;
    f.b = w;
    f.w = (gpuipc__w_word){2, 4096, 0, 0, 5};
    int frames = 1;
    if (strcmp(what, "bufw_word_outside") == 0)
      f.w.off = (uint64_t)64 << 20;
    else if (strcmp(what, "bufw_misaligned") == 0)
      f.w.off = 4100;
    else if (strcmp(what, "bufw_value_zero") == 0)
      f.w.value = 0;
    else if (strcmp(what, "bufw_value_past_limit") == 0)
      f.w.value = GPUIPC__SEQ_LIMIT;
    else if (strcmp(what, "bufw_event_flag") == 0)
      f.b.flags |= GPUIPC__BUF_EVENT;
    else if (strcmp(what, "bufw_unknown_chunk") == 0)
      f.w.chunk = 7;
    else if (strcmp(what, "bufw_word_is_a_flag_word") == 0)
      f.w.off = 8; /* slot 1's ready word: close writes it itself */
    else if (strcmp(what, "bufw_too_many_words") == 0)
      frames = GPUIPC__BWORDS_MAX + 1;
    for (int i = 0; i < frames; i++) {
      f.b.slot = 1 + (uint32_t)i;
      f.b.seq = 100 + (uint64_t)i;
      f.w.off = frames > 1 ? 4096 + 8 * (uint64_t)i : f.w.off;
      raw_frame(fd, GPUIPC__F_BUFW, &f, sizeof f);
    }
  } else if (strncmp(what, "bufs_", 5) == 0) {
    /* A batch of three (each valid on its own unless the case breaks
     * one): none of it may be delivered. */
    struct {
      gpuipc__w_bufs h;
      gpuipc__w_buf e[3];
      uint32_t meta[3];
    } f;
    memset(&f, 0, sizeof f);
    f.h = (gpuipc__w_bufs){3, 2, 0, 0};
    for (int i = 0; i < 3; i++) {
      f.e[i] = w;
      f.e[i].slot = 1 + (uint32_t)i;
      f.e[i].seq = 100 + (uint64_t)i;
      f.e[i].meta_len = 4;
    }
    size_t n = sizeof f;
    /* The real block first comes back (so the victim received it). */
    size_t out = 1;
    for (int i = 0; i < 3000 && out > 0; i++) {
      ASSERT_OK(gpuipc_conn_progress(c, 10));
      ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    }
    ASSERT_EQ(out, 0);
    if (strcmp(what, "bufs_dup_slot") == 0)
      f.e[2].slot = 1;
    else if (strcmp(what, "bufs_bad_entry") == 0)
      f.e[1].off = (uint64_t)64 << 20;
    else if (strcmp(what, "bufs_count") == 0)
      f.h.count = 0;
    else if (strcmp(what, "bufs_too_many") == 0)
      f.h.count = 4;
    else if (strcmp(what, "bufs_ready") == 0)
      f.h.ready = 0;
    else if (strcmp(what, "bufs_meta_total") == 0)
      n -= 2;
    else if (strcmp(what, "bufs_desc") == 0)
      f.e[1].flags |= GPUIPC__BUF_DESC;
    else if (strcmp(what, "bufs_seq_order") == 0)
      f.e[2].seq = 100;
    else if (strcmp(what, "bufs_seq_past_limit") == 0)
      f.e[2].seq = GPUIPC__SEQ_LIMIT;
    raw_frame(fd, GPUIPC__F_BUFS, &f, n);
  }
  /* Wait until the victim hangs up on us. Buffers it took from frames it
   * accepted before the one it refused come back as releases this side's
   * lease table never gave out (they were forged): that ends the
   * connection here first, as a protocol error. */
  char b;
  size_t len;
  /* A broadcast forger leaves soon: the victim's close waits for its
   * broadcast words, which it writes itself only once the forger is gone
   * (they are the forger's to write while it lives). */
  if (strncmp(what, "bufw_", 5) == 0)
    ASSERT_OK(gpuipc_conn_set_timeout(c, 500));
  gpuipc_status s = gpuipc_conn_recv_msg(c, &b, 1, &len, NULL, NULL);
  /* CLOSED: the forged releases ended it here in a pass that returned
   * another status first (the reason is the same protocol error). */
  if (s != GPUIPC_E_PEER_GONE && s != GPUIPC_E_TIMEOUT &&
      s != GPUIPC_E_PROTOCOL && s != GPUIPC_E_CLOSED)
    harness_fail(__FILE__, __LINE__, "forger %s: the connection ended with %s (%s)",
                 what, gpuipc_status_name(s), gpuipc_last_error());
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(handoff_rejects_forged_frames) {
  REQUIRE_DEVICES(1);
  static const struct {
    const char *what, *text;
  } cases[] = {
      {"buf_before_ctl", "before CTL"},
      {"rel_unheld", "REL"},
      {"chunk_garbage", "peer pid"},
      {"buf_out_of_range", "outside the chunk"},
      {"buf_slot", "slot"},
      {"buf_meta_len", "metadata"},
      {"buf_unknown_chunk", "never sent"},
      {"buf_done_unordered", "DONE only with ORDERED"},
      {"buf_seq_past_limit", "past the limit"},
      {"bufs_dup_slot", "busy"},
      {"bufs_bad_entry", "outside the chunk"},
      {"bufs_count", "entries"},
      {"bufs_too_many", "entries"},
      {"bufs_ready", "ready entry"},
      {"bufs_meta_total", "metadata"},
      {"bufs_desc", "refused"},
      {"bufs_seq_order", "refused"},
      {"bufs_seq_past_limit", "past the limit"},
      {"bufw_word_outside", "outside the peer's imported memory"},
      {"bufw_misaligned", "misaligned"},
      {"bufw_value_zero", "past the limit"},
      {"bufw_value_past_limit", "past the limit"},
      {"bufw_event_flag", "ORDERED only"},
      {"bufw_unknown_chunk", "imported memory"},
      {"bufw_word_is_a_flag_word", "one of the connection's flag words"},
      {"bufw_too_many_words", "broadcast words"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    /* A stream per case: buffers of forged broadcast frames accepted
     * before the refused one wait on words the forger never writes, so
     * their stream may stay blocked for good. */
    CUstream s = mkstream();
    bool bufw = strncmp(cases[i].what, "bufw_", 5) == 0;
    int fd;
    pid_t pid = spawn_helper("ho_forger", NULL, &fd, (char *)cases[i].what, NULL);
    gpuipc_conn *c = pair_conn(fd);
    /* The forger's first frame follows its CUDA start, seconds on a GPU
     * machine that runs many such tests at once. */
    ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
    gpuipc_status st = GPUIPC_OK;
    int oks = 0;
    for (int k = 0; k < 3 + GPUIPC__BWORDS_MAX && st == GPUIPC_OK; k++) {
      gpuipc_received r = GPUIPC_RECEIVED_INIT;
      st = gpuipc_conn_recv(c, (struct CUstream_st *)s, &r);
      if (k == 0) /* the forger is up: the usual limit for the rest */
        ASSERT_OK(gpuipc_conn_set_timeout(c, 30000));
      if (st == GPUIPC_OK) {
        oks++;
        ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
      }
    }
    /* A forged batch is refused whole: only the real block came. */
    if (strncmp(cases[i].what, "bufs_", 5) == 0 && oks != 1)
      harness_fail(__FILE__, __LINE__, "case %s: %d buffers delivered",
                   cases[i].what, oks);
    if (st != GPUIPC_E_PROTOCOL)
      harness_fail(__FILE__, __LINE__, "case %s: %s (%s)", cases[i].what,
                   gpuipc_status_name(st), gpuipc_last_error());
    ASSERT_STR_CONTAINS(gpuipc_last_error(), cases[i].text);
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_STATUS(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r),
                  GPUIPC_E_CLOSED);
    gpuipc_conn_close(c);
    ASSERT_EQ(wait_helper(pid, 60), 0);
    if (!bufw)
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    if (s)
      ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  }
  return 0;
}

/* ---- the same in event mode and on the legacy default stream ------------------------- */

TEST_IMPL(handoff_event_order_reuse_after_release) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_order_reuse_after_release();
}

TEST_IMPL(handoff_legacy_order_reuse_after_release) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_order_reuse_after_release();
}

/* ---- batches ------------------------------------------------------------------------- */

/* Releasing a batch with a bad id (unknown, or named twice) releases
 * none of it; partial receives of a batch work; every buffer's release is
 * its own. */
TEST_IMPL(handoff_batch_release_all_or_nothing) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_batch_producer", NULL, &fd, "2", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_received rs[8];
  for (int i = 0; i < 8; i++)
    rs[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
  size_t n = 0;
  /* Up to 3 of the first batch of 8 (one frame: all 8 are queued). */
  ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs, 3, &n));
  ASSERT_EQ(n, 3);
  size_t got = n;
  while (got < 8) {
    ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs + got,
                                     8 - got, &n));
    got += n;
  }
  ASSERT_EQ(got, 8);
  for (int i = 0; i < 8; i++) {
    uint32_t seed;
    ASSERT_EQ(rs[i].meta_len, sizeof seed);
    memcpy(&seed, rs[i].meta, sizeof seed);
    ASSERT_EQ(seed, 300u + (uint32_t)i); /* in order */
  }
  uint64_t ids[8];
  for (int i = 0; i < 8; i++)
    ids[i] = rs[i].id;
  size_t here = 0;
  uint64_t bad[3] = {ids[0], ids[1] ^ ((uint64_t)1 << 40), ids[2]};
  ASSERT_STATUS(gpuipc_conn_release_batch(c, bad, 3, (struct CUstream_st *)s),
                GPUIPC_E_NOT_FOUND);
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 8);
  uint64_t twice[3] = {ids[3], ids[4], ids[3]};
  ASSERT_STATUS(gpuipc_conn_release_batch(c, twice, 3, (struct CUstream_st *)s),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "twice");
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 8);
  ASSERT_STATUS(gpuipc_conn_release_batch(c, ids, 0, (struct CUstream_st *)s),
                GPUIPC_E_INVALID_ARG);
  /* One on its own, the rest together. */
  ASSERT_OK(gpuipc_conn_release(c, ids[7], (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_release_batch(c, ids, 7, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 0);
  ASSERT_STATUS(gpuipc_conn_release_batch(c, ids, 1, (struct CUstream_st *)s),
                GPUIPC_E_NOT_FOUND);
  /* The second batch, one by one. */
  for (int i = 0; i < 8; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    uint32_t seed;
    memcpy(&seed, r.meta, sizeof seed);
    ASSERT_EQ(seed, 308u + (uint32_t)i);
    ASSERT_OK(gpuipc_conn_release_batch(c, &r.id, 1, (struct CUstream_st *)s));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_conn_close(c);
  return 0;
}

/* ---- batches: ordering of coalesced releases ----------------------------------------- */

/* Receives a batch of argv[0] buffers, copies each (slowly: the emulator's
 * delay) into memory of its own, releases them all in one call, says
 * "released", and once the producer has overwritten the memory, checks
 * its copies. */
HELPER_IMPL(ho_batch_reuse) {
  int count = atoi(argv[0]);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received *rs = calloc((size_t)count, sizeof *rs);
  CUdeviceptr *priv = calloc((size_t)count, sizeof *priv);
  ASSERT(rs && priv);
  for (int i = 0; i < count; i++)
    rs[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
  for (int got = 0; got < count;) {
    size_t n = 0;
    ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs + got,
                                     (size_t)(count - got), &n));
    got += (int)n;
  }
  uint64_t *ids = calloc((size_t)count, sizeof *ids);
  for (int i = 0; i < count; i++) {
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv[i], rs[i].length));
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv[i], (CUdeviceptr)(uintptr_t)rs[i].ptr,
                                          rs[i].length, s));
    ids[i] = rs[i].id;
  }
  ASSERT_OK(gpuipc_conn_release_batch(c, ids, (size_t)count,
                                      (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_send_msg(c, "released", 8, NULL, 0));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < count; i++) {
    uint8_t *host = malloc(rs[i].length);
    ASSERT_NOT_NULL(host);
    d2h(host, (void *)(uintptr_t)priv[i], rs[i].length);
    uint32_t seed;
    memcpy(&seed, rs[i].meta, sizeof seed);
    check_pattern(host, rs[i].length, seed);
    free(host);
    ASSERT_CU(gpuipc__cu.cuMemFree(priv[i]));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  gpuipc_status st = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  free(rs);
  free(priv);
  free(ids);
  gpuipc_conn_close(c);
  return 0;
}

/* The consumer releases a batch of 8 with one flag word while its copies
 * out of every buffer are still queued (slow): the producer's reuse of
 * each buffer's memory, the first ones too, waits for them. */
TEST_IMPL(handoff_batch_release_orders_reuse) {
  REQUIRE_DEVICES(1);
  enum { N = 8 };
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)64 << 20;
  int fd;
  pid_t pid = spawn_helper("ho_batch_reuse", harness_on_emulator() ? delay_env : NULL,
                           &fd, "8", NULL);
  gpuipc_conn *c = pair_conn(fd);
  /* Room for the flag words and exactly N blocks: the reuse below gets
   * the same memory back. */
  gpuipc_arena *a = mkarena(N * n + 8192);
  CUstream s = mkstream();
  gpuipc_block *bs[N];
  uint8_t *pin[N];
  uint32_t seeds[N];
  const void *metas[N];
  size_t lens[N];
  void *ptrs[N];
  for (int i = 0; i < N; i++) {
    seeds[i] = 900 + (uint32_t)i;
    bs[i] = filled_block(a, s, n, seeds[i], &pin[i]);
    metas[i] = &seeds[i];
    lens[i] = sizeof seeds[i];
    ptrs[i] = gpuipc_block_get_ptr(bs[i]);
  }
  ASSERT_OK(gpuipc_conn_send_batch(c, bs, N, (struct CUstream_st *)s, metas,
                                   lens));
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 8);
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  /* Every block's memory back, overwritten at once on s (not synced). */
  for (int i = 0; i < N; i++) {
    gpuipc_block *b2 = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b2));
    bool known = false;
    for (int k = 0; k < N; k++)
      known |= gpuipc_block_get_ptr(b2) == ptrs[k];
    ASSERT(known);
    ASSERT_CU(gpuipc__cu.cuMemsetD8Async(
        (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b2), 0x55, n, s));
    bs[i] = b2;
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "overwritten", 11, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < N; i++) {
    uint8_t probe[4];
    d2h(probe, gpuipc_block_get_ptr(bs[i]), sizeof probe);
    ASSERT_EQ(probe[0], 0x55);
    ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin[i]));
  }
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- batches in event mode and on the legacy stream ---------------------------------- */

TEST_IMPL(handoff_event_batch_release_orders_reuse) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_batch_release_orders_reuse();
}

TEST_IMPL(handoff_legacy_batch_release_orders_reuse) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_batch_release_orders_reuse();
}
