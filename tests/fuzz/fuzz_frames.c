/*
 * fuzz_frames.c: libFuzzer target for the connection's frame decoder (and
 * the fast-path handlers behind it: CHUNK, CTL, BUF, BUFD, EVD, REL, BYE,
 * MSG). The peer completes a valid handshake, then sends the input as its
 * byte stream; the connection is driven with zero timeouts until it stops.
 * It must end cleanly or keep working: no crash, no hang, no leaked memory
 * (LeakSanitizer) or descriptor.
 *
 * Input: byte 0 says how to send the rest,
 *   bits 0-2  descriptors (copies of /dev/null) sent with the first byte
 *   bit 3     leave frame header checks as they are (else made right)
 *   bits 4-5  the connection's order mode (3: MEMOP)
 *   bit 6     keep the peer's end open (else it shuts down after sending)
 *   bit 7     send it in two writes, the first (with the descriptors) of
 *             1 + (byte 1) % (length - 1) bytes
 */
#include "fuzz_conn.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_conn_init();
  return 0;
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
  int one = 1;
  (void)setsockopt(sv[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof one);
  int big = 1 << 20;
  (void)setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  uint8_t hs[128];
  size_t hl = fuzz_hello(hs, 256);
  if (fuzz_send(sv[1], hs, hl, 0) != 0)
    abort();
  hl = fuzz_accept_frame(hs);
  if (fuzz_send(sv[1], hs, hl, 0) != 0)
    abort();
  size_t first = n;
  if ((ctl & 0x80) && n > 1)
    first = 1 + (size_t)stream[0] % (n - 1);
  int nfds = ctl & 7;
  (void)fuzz_send(sv[1], stream, first, nfds);
  (void)fuzz_send(sv[1], stream + first, n - first, 0);
  if (!(ctl & 0x40))
    shutdown(sv[1], SHUT_WR);

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
  gpuipc_conn_close(c);
  close(sv[1]);
  free(stream);
  fuzz_check_fds("fuzz-frames");
  return 0;
}
