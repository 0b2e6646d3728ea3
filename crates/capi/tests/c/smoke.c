/* A C program against liballreduce_c: a 2-rank in-process host group, one pthread per rank,
 * f32 and bf16 sums checked bit for bit, one refused call and the group's recovery.
 * Built and run by tests/c_smoke.rs; prints "smoke: ok" and exits 0 when every check holds. */

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "allreduce.h"

#define WORLD 2
#define COUNT 1000

static ar_comm_t comms[WORLD];
static int failures[WORLD];

#define CHECK(rank, cond, ...)                                       \
  do {                                                               \
    if (!(cond)) {                                                   \
      fprintf(stderr, "rank %d: %s:%d: ", rank, __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                  \
      fprintf(stderr, " (last error: %s)\n", ar_last_error());       \
      failures[rank]++;                                              \
      return NULL;                                                   \
    }                                                                \
  } while (0)

/* Values every sum of which is exact in f32 and in bf16 (small multiples of 1/4), so the
 * expected result is the plain sum, whatever the order. */
static float value(int rank, int i) { return (float)((i * 7 + rank * 3) % 64) * 0.25f - 4.0f; }

static uint16_t to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return (uint16_t)(bits >> 16); /* exact for the values above */
}

static void* rank_main(void* arg) {
  int rank = (int)(intptr_t)arg;
  ar_comm_t comm = comms[rank];
  _Alignas(16) float send[COUNT];
  _Alignas(16) float recv[COUNT];
  _Alignas(16) uint16_t half[COUNT];

  int r = -1, n = -1;
  CHECK(rank, ar_comm_user_rank(comm, &r) == AR_SUCCESS && r == rank, "user rank %d", r);
  CHECK(rank, ar_comm_count(comm, &n) == AR_SUCCESS && n == WORLD, "count %d", n);

  /* f32, out of place. */
  for (int i = 0; i < COUNT; i++) send[i] = value(rank, i);
  ar_result_t res = ar_all_reduce(send, recv, COUNT, AR_FLOAT32, AR_SUM, AR_EXACT,
                                  AR_STRATEGY_AUTO, comm, NULL);
  CHECK(rank, res == AR_SUCCESS, "f32 all-reduce returned %d", (int)res);
  for (int i = 0; i < COUNT; i++) {
    float want = value(0, i) + value(1, i);
    CHECK(rank, memcmp(&recv[i], &want, sizeof want) == 0, "f32 [%d] = %g, want %g", i,
          recv[i], want);
  }

  /* bf16, in place, two-shot. */
  for (int i = 0; i < COUNT; i++) half[i] = to_bf16(value(rank, i));
  res = ar_all_reduce(half, half, COUNT, AR_BFLOAT16, AR_SUM, AR_EXACT, AR_STRATEGY_TWOSHOT,
                      comm, NULL);
  CHECK(rank, res == AR_SUCCESS, "bf16 all-reduce returned %d", (int)res);
  for (int i = 0; i < COUNT; i++) {
    uint16_t want = to_bf16(value(0, i) + value(1, i));
    CHECK(rank, half[i] == want, "bf16 [%d] = %#x, want %#x", i, half[i], want);
  }

  /* Rank 1 passes a dtype that names nothing: it is refused, and rank 0 hears of it at once
   * instead of waiting for the deadline. */
  int dtype = rank == 1 ? 42 : AR_FLOAT32;
  res = ar_all_reduce(send, recv, COUNT, dtype, AR_SUM, AR_EXACT, AR_STRATEGY_AUTO, comm, NULL);
  if (rank == 1) {
    CHECK(rank, res == AR_INVALID_ARGUMENT, "bad dtype returned %d", (int)res);
    CHECK(rank, strstr(ar_last_error(), "dtype 42") != NULL, "message");
  } else {
    CHECK(rank, res == AR_PEER_REJECTED, "peer of a bad dtype returned %d", (int)res);
    CHECK(rank, strstr(ar_last_error(), "rank 1 rejected") != NULL, "message");
  }

  /* The group still works. */
  memset(recv, 0, sizeof recv);
  res = ar_all_reduce(send, recv, COUNT, AR_FLOAT32, AR_SUM, AR_EXACT, AR_STRATEGY_ONESHOT, comm,
                      NULL);
  CHECK(rank, res == AR_SUCCESS, "all-reduce after the refusal returned %d", (int)res);
  for (int i = 0; i < COUNT; i++) {
    float want = value(0, i) + value(1, i);
    CHECK(rank, memcmp(&recv[i], &want, sizeof want) == 0, "after: [%d] = %g", i, recv[i]);
  }
  return NULL;
}

int main(void) {
  int version = 0;
  if (ar_get_version(&version) != AR_SUCCESS || version != AR_VERSION_CODE) {
    fprintf(stderr, "version %d, header %d\n", version, AR_VERSION_CODE);
    return 1;
  }
  ar_config_t config;
  memset(&config, 0, sizeof config);
  config.size = sizeof config;
  config.timeout_ms = 5000;
  ar_result_t res = ar_comm_init_all(comms, AR_BACKEND_HOST, WORLD, NULL, &config);
  if (res != AR_SUCCESS) {
    fprintf(stderr, "init: %s: %s\n", ar_get_error_string(res), ar_last_error());
    return 1;
  }
  /* A null handle is refused, not dereferenced. */
  int n = 0;
  if (ar_comm_count(NULL, &n) != AR_INVALID_USAGE || ar_last_error()[0] == '\0') {
    fprintf(stderr, "a null handle was not refused\n");
    return 1;
  }

  pthread_t threads[WORLD];
  for (int r = 0; r < WORLD; r++) pthread_create(&threads[r], NULL, rank_main, (void*)(intptr_t)r);
  for (int r = 0; r < WORLD; r++) pthread_join(threads[r], NULL);
  for (int r = 0; r < WORLD; r++) {
    if (ar_comm_destroy(comms[r]) != AR_SUCCESS) failures[r]++;
  }
  if (failures[0] + failures[1] != 0) return 1;
  printf("smoke: ok\n");
  return 0;
}
