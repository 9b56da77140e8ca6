/*
 * fuzz_frames.c: libFuzzer target for the connection's frame decoder (and
 * the fast-path handlers behind it: CHUNK, CTL, BUF, BUFD, BUFS, BUFW,
 * EVD, REL, BYE, MSG). The peer completes a valid handshake, then sends the input as its
 * byte stream; the connection is driven with zero timeouts until it stops.
 * It must end cleanly or keep working: no crash, no hang, no leaked memory
 * (LeakSanitizer) or descriptor.
 *
 * Frames that import memory need memory that was really exported, by
 * another process (the driver refuses a process's own handles): at
 * start-up a child process (a real exporter: an arena on the emulator, a
 * connection) sends two blocks to a socket of ours and then waits for us
 * to exit; its frames (the
 * arena's chunk with its descriptor, the flag words, two BUF frames) are
 * recorded. An input can have them sent first, with duplicates of the
 * exporter's descriptors, so that its own frames reach the states behind a
 * successful import (buffers queued, received, released; chunks and slots
 * in use).
 *
 * Input: byte 0 says how to send the rest,
 *   bits 0-2  descriptors (copies of /dev/null) sent with the first byte
 *   bit 3     leave frame header checks as they are (else made right)
 *   bits 4-5  the connection's order mode (3: MEMOP)
 *   bit 6     keep the peer's end open (else it shuts down after sending)
 *   bit 7     the real exporter's recorded frames come first
 *
 * FUZZ_FRAMES_STALL=1 in the environment leaves the exporter's flag words
 * unwritten (see signal_bufs): an input with a forged BUF then hangs.
 *
 * After the close, the legacy stream (the one this harness receives and
 * releases on) must drain, and a close that had to keep its imports
 * mapped must be finished once the words its waits read are written.
 */
#include "fuzz_conn.h"

/* The recorded frames: bytes, and for each frame that carries
 * descriptors, where it starts and the descriptors (kept open here). */
static uint8_t rec[16384];
static size_t rec_len;
static struct {
  size_t off, len;
  int nfds;
  int fds[GPUIPC__FRAME_FDS_MAX];
} recf[16];
static int nrecf;

/* The child: connects over sv, sends two blocks, waits for the parent's
 * end of `life` to close, exits. */
static void exporter_main(int sv, int life) {
  fuzz_conn_init();
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 5000;
  gpuipc_conn *exporter = NULL;
  gpuipc_status s = gpuipc_conn_from_fd(sv, &o, &exporter);
  if (s != GPUIPC_OK)
    fuzz_die("exporter handshake", s);
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = 1 << 20;
  gpuipc_arena *arena = NULL;
  s = gpuipc_arena_create(&ao, &arena);
  if (s != GPUIPC_OK)
    fuzz_die("arena_create (is the emulator the driver?)", s);
  for (int i = 0; i < 2; i++) {
    gpuipc_block *b = NULL;
    s = gpuipc_arena_alloc(arena, 4096, NULL, &b);
    if (s != GPUIPC_OK)
      fuzz_die("arena_alloc", s);
    s = gpuipc_conn_send(exporter, b, NULL, "meta", 4);
    if (s != GPUIPC_OK)
      fuzz_die("conn_send", s);
  }
  char c;
  while (read(life, &c, 1) > 0 || errno == EINTR)
    ;
  _exit(0);
}

/* Whether both BUF frames are among the complete frames of p. */
static bool two_bufs_in(const uint8_t *p, size_t len) {
  size_t off = 0;
  int n = 0;
  while (len - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, p + off, sizeof h);
    if (h.len > len - off - sizeof h)
      break;
    n += h.type == GPUIPC__F_BUF;
    off += sizeof h + h.len;
  }
  return n >= 2;
}

static void record_exporter(void) {
  int fd = fuzz_spawn_peer(exporter_main);
  /* Read what it sent: its HELLO, ACCEPT, then the frames to keep (until
   * both BUF frames are in, or the child is silent for 10 s). */
  uint8_t all[sizeof rec + 256];
  int fds[64], nfds = 0;
  size_t got = fuzz_record(fd, all, sizeof all, fds, 64, &nfds, two_bufs_in,
                           10000);
  close(fd); /* the exporter never reads again; its frames are recorded */
  size_t off = 0;
  int frame = 0, fdi = 0;
  while (got - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, all + off, sizeof h);
    size_t flen = sizeof h + h.len;
    if (flen > got - off)
      break;
    if (frame >= 2 && rec_len + flen <= sizeof rec) {
      if (h.nfds > 0 && nrecf < 16) {
        recf[nrecf].off = rec_len;
        recf[nrecf].len = flen;
        recf[nrecf].nfds = h.nfds;
        for (int i = 0; i < h.nfds && fdi < nfds; i++)
          recf[nrecf].fds[i] = fds[fdi++];
        nrecf++;
      }
      memcpy(rec + rec_len, all + off, flen);
      rec_len += flen;
    } else {
      fdi += h.nfds;
    }
    off += flen;
    frame++;
  }
  if (nrecf == 0 || getenv("FUZZ_FRAMES_VERBOSE"))
    fprintf(stderr, "recorded %d frames (%zu bytes, %d with descriptors)\n",
            frame - 2, rec_len, nrecf);
}

/* The exporter's flag words, mapped here for good (an import of the
 * chunk its CTL frame names), and their values after its two sends. A
 * BUF frame the input forges for the real chunk makes gpuipc_conn_recv
 * queue a wait for a sequence number the exporter never writes, and
 * gpuipc_conn_close then waits for it forever (cuCtxSynchronize): a known
 * defect, whose regression test is conn_hostile_buf_close_is_bounded in
 * tests/test-fuzz-corpus.c. So that it does not stop the search for
 * others, the harness plays the exporter's part before closing: it
 * writes, for every BUF or BUFD frame of the input, its sequence number
 * into the slot's ready word (what an exporter's GPU would do), and puts
 * the recorded values back after the close. */
static gpuipc_buffer *flag_words;
static CUdeviceptr ready_base;
static uint32_t ready_slots;
static uint64_t ready_saved[65536];
/* The flag words' chunk (where a forged BUFW may name a broadcast word
 * that a wait of the connection then reads), and the broadcast words the
 * harness wrote for an input, with their values before. */
static uint64_t flag_arena, flag_size;
static uint32_t flag_chunk;
static CUdeviceptr flag_base;
static struct {
  CUdeviceptr addr;
  uint64_t old;
} bw_saved[64];
static int nbw_saved;

/* Plays the exporter: the input's BUF/BUFD sequence numbers, in order.
 * Written by the host straight into the mapping: the emulator's device
 * memory is host memory and its waits poll (a driver call would not do:
 * the legacy stream, and every synchronous call, is joined to the waits,
 * and so was, on the emulator, a stream of our own). */
static void signal_bufs(const uint8_t *p, size_t len) {
  size_t off = 0;
  while (len - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, p + off, sizeof h);
    if (h.len > len - off - sizeof h)
      break;
    if ((h.type == GPUIPC__F_BUF || h.type == GPUIPC__F_BUFD) &&
        h.len >= sizeof(gpuipc__w_buf)) {
      gpuipc__w_buf w;
      memcpy(&w, p + off + sizeof h, sizeof w);
      if (w.slot < ready_slots)
        __atomic_store_n((uint64_t *)(uintptr_t)(ready_base + 8u * w.slot),
                         w.seq, __ATOMIC_SEQ_CST);
    }
    /* A broadcast word in the flag words' chunk: the newest value named
     * (the exporter's GPU writes it after its work). */
    if (h.type == GPUIPC__F_BUFW &&
        h.len >= sizeof(gpuipc__w_buf) + sizeof(gpuipc__w_word)) {
      gpuipc__w_word ww;
      memcpy(&ww, p + off + sizeof h + sizeof(gpuipc__w_buf), sizeof ww);
      if (ww.arena_id == flag_arena && ww.chunk == flag_chunk &&
          ww.off % 8 == 0 && flag_size >= 8 && ww.off <= flag_size - 8 &&
          nbw_saved < (int)(sizeof bw_saved / sizeof bw_saved[0])) {
        uint64_t *word = (uint64_t *)(uintptr_t)(flag_base + ww.off);
        uint64_t cur = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        bw_saved[nbw_saved].addr = flag_base + ww.off;
        bw_saved[nbw_saved++].old = cur;
        if (ww.value > cur)
          __atomic_store_n(word, ww.value, __ATOMIC_SEQ_CST);
      }
    }
    off += sizeof h + h.len;
  }
}

static void restore_ready_words(void) {
  while (nbw_saved > 0) { /* the last first: the oldest value wins */
    nbw_saved--;
    __atomic_store_n((uint64_t *)(uintptr_t)bw_saved[nbw_saved].addr,
                     bw_saved[nbw_saved].old, __ATOMIC_SEQ_CST);
  }
  for (uint32_t i = 0; i < ready_slots; i++)
    __atomic_store_n((uint64_t *)(uintptr_t)(ready_base + 8u * i),
                     ready_saved[i], __ATOMIC_SEQ_CST);
}

static void find_flag_words(void) {
  const uint8_t *ctlp = NULL;
  size_t off = 0;
  while (rec_len - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, rec + off, sizeof h);
    if (h.type == GPUIPC__F_CTL && h.len == sizeof(gpuipc__w_ctl))
      ctlp = rec + off + sizeof h;
    off += sizeof h + h.len;
  }
  if (ctlp == NULL)
    abort();
  gpuipc__w_ctl w;
  memcpy(&w, ctlp, sizeof w);
  for (int i = 0; i < nrecf; i++) {
    gpuipc__frame_hdr h;
    gpuipc__w_chunk ch;
    memcpy(&h, rec + recf[i].off, sizeof h);
    memcpy(&ch, rec + recf[i].off + sizeof h, sizeof ch);
    if (h.type != GPUIPC__F_CHUNK || ch.arena_id != w.arena_id ||
        ch.chunk != w.chunk)
      continue;
    gpuipc_status s = gpuipc_buffer_import(
        rec + recf[i].off + sizeof h + sizeof ch, ch.desc_len, recf[i].fds,
        recf[i].nfds, NULL, &flag_words);
    if (s != GPUIPC_OK)
      fuzz_die("import of the exporter's flag words", s);
    flag_arena = w.arena_id;
    flag_chunk = w.chunk;
    flag_base = (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(flag_words);
    flag_size = gpuipc_buffer_get_size(flag_words);
    ready_base = flag_base + w.off;
    ready_slots = w.nslots;
    /* What the exporter's GPU writes for its two sends (perhaps not yet):
     * each recorded BUF frame's sequence number in its slot. */
    for (size_t o2 = 0; rec_len - o2 >= sizeof(gpuipc__frame_hdr);) {
      gpuipc__frame_hdr fh;
      memcpy(&fh, rec + o2, sizeof fh);
      if (fh.type == GPUIPC__F_BUF && fh.len >= sizeof(gpuipc__w_buf)) {
        gpuipc__w_buf b;
        memcpy(&b, rec + o2 + sizeof fh, sizeof b);
        if (b.slot < ready_slots && b.seq > ready_saved[b.slot])
          ready_saved[b.slot] = b.seq;
      }
      o2 += sizeof fh + fh.len;
    }
    restore_ready_words();
    return;
  }
  abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  record_exporter(); /* first: the child starts the driver itself */
  fuzz_conn_init();
  find_flag_words();
  return 0;
}

/* Sends the recorded frames: those with descriptors each on its own. */
static void send_recorded(int fd) {
  size_t off = 0;
  for (int i = 0; i < nrecf; i++) {
    (void)fuzz_send(fd, rec + off, recf[i].off - off, 0);
    (void)fuzz_send_fds(fd, rec + recf[i].off, recf[i].len, recf[i].fds,
                        recf[i].nfds);
    off = recf[i].off + recf[i].len;
  }
  (void)fuzz_send(fd, rec + off, rec_len - off, 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 4 * GPUIPC__FRAME_MAX)
    return 0;
  uint8_t ctl = data[0];
  size_t n = size - 1;
  uint8_t *stream = malloc(n ? n : 1);
  if (stream == NULL)
    return 0;
  if (n)
    memcpy(stream, data + 1, n);
  if (!(ctl & 0x08))
    fuzz_fix_checks(stream, n);

  int sv[2];
  if (gpuipc_conn_pair(sv) != GPUIPC_OK)
    abort();
  int big = 1 << 20;
  (void)setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  fuzz_hello_accept(sv[1]);
  if (ctl & 0x80)
    send_recorded(sv[1]);
  (void)fuzz_send(sv[1], stream, n, ctl & 7);
  if (!(ctl & 0x40))
    shutdown(sv[1], SHUT_WR);

  size_t held_before = gpuipc__handoff_held_poll();
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.nonblocking = 1;
  o.timeout_ms = 1000;
  int mode = (ctl >> 4) & 3;
  o.order = mode == 3 ? GPUIPC_ORDER_MEMOP : (gpuipc_order_mode)mode;
  gpuipc_conn *c = NULL;
  gpuipc_status s = gpuipc_conn_from_fd(sv[0], &o, &c);
  if (s != GPUIPC_OK)
    fuzz_die("the handshake (valid) failed", s);
  fuzz_drive(c);
  bool play = (ctl & 0x80) && !getenv("FUZZ_FRAMES_STALL");
  if (play)
    signal_bufs(stream, n);
  gpuipc_conn_close(c);
  /* What close unblocked must pass: the legacy stream (the one this
   * harness receives and releases on) drains. Before the exporter's words
   * are put back: a wait still pending then would see a rewound word and
   * hold the legacy stream, and every later input's work on it, for good
   * (as a hostile exporter could, which only stalls the streams that
   * received from it). Event mode is left out: its documented limit. */
  if (!fuzz_drain_legacy(2000) && o.order != GPUIPC_ORDER_EVENT)
    fuzz_die("the legacy stream is still blocked 2 s after close", GPUIPC_OK);
  /* A close that could not unmap yet (the peer's words not written when
   * it ran) is finished by a later call: here, now that they are. */
  size_t kept = gpuipc__handoff_held_poll();
  for (int i = 0; i < 2000 && kept > held_before; i++) {
    usleep(1000);
    kept = gpuipc__handoff_held_poll();
  }
  if (kept > held_before && o.order != GPUIPC_ORDER_EVENT)
    fuzz_die("a closed connection's imports stay mapped after its words were "
             "written", GPUIPC_OK);
  if (play)
    restore_ready_words();
  close(sv[1]);
  free(stream);
  fuzz_check_fds("fuzz-frames");
  return 0;
}
