/* tdist-bench-mpi: the Open MPI anchor of `tdist-bench collective --anchor mpi`, which starts it
 * with `mpirun -np N` and reads what rank 0 prints. One collective over the given sizes, float32,
 * sum, in place wherever MPI allows it, with the timing rule of tdist-bench collective: each rank
 * times every iteration, the slowest rank's time of each iteration is taken (MPI_MAX), the row
 * is the median over the iterations (the lower middle one for an even count, as at::median).
 * Sizes mean what they mean in tdist-bench collective (the whole buffer; the whole gathered
 * buffer of allgather/gather; each rank's buffer of alltoall).
 *
 *   mpirun -np N tdist-bench-mpi OP WARMUP ITERS BYTES...
 *
 * Prints one line per size on rank 0: "BYTES TIME_US". Exit status 2 on bad arguments. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

/* One call of `op` on `count` floats; a and b hold count floats each. */
static void run_op(const char* op, float* a, float* b, int count, int n, int rank) {
  const int block = count / n;
  if (strcmp(op, "allreduce") == 0) {
    MPI_Allreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (strcmp(op, "broadcast") == 0) {
    MPI_Bcast(a, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
  } else if (strcmp(op, "reduce") == 0) {
    MPI_Reduce(rank == 0 ? MPI_IN_PLACE : a, a, count, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
  } else if (strcmp(op, "allgather") == 0) {
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, a, block, MPI_FLOAT, MPI_COMM_WORLD);
  } else if (strcmp(op, "reduce_scatter") == 0) {
    MPI_Reduce_scatter_block(MPI_IN_PLACE, a, block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (strcmp(op, "gather") == 0) {
    MPI_Gather(rank == 0 ? MPI_IN_PLACE : a + (size_t)rank * block, block, MPI_FLOAT, a, block,
               MPI_FLOAT, 0, MPI_COMM_WORLD);
  } else if (strcmp(op, "scatter") == 0) {
    MPI_Scatter(a, block, MPI_FLOAT, rank == 0 ? MPI_IN_PLACE : b, block, MPI_FLOAT, 0,
                MPI_COMM_WORLD);
  } else if (strcmp(op, "alltoall") == 0) {
    MPI_Alltoall(a, block, MPI_FLOAT, b, block, MPI_FLOAT, MPI_COMM_WORLD);
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

static int known_op(const char* op) {
  static const char* ops[] = {"allreduce", "broadcast", "reduce",   "allgather", "reduce_scatter",
                              "gather",    "scatter",   "alltoall", "barrier"};
  for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); ++i) {
    if (strcmp(op, ops[i]) == 0) return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 5 || !known_op(argv[1]) || atoi(argv[2]) < 0 || atoi(argv[3]) < 1) {
    if (rank == 0) fprintf(stderr, "usage: tdist-bench-mpi OP WARMUP ITERS BYTES...\n");
    MPI_Finalize();
    return 2;
  }
  const char* op = argv[1];
  const int warmup = atoi(argv[2]), iters = atoi(argv[3]);
  double* times = malloc(sizeof(double) * (size_t)iters);
  for (int s = 4; s < argc; ++s) {
    const long long bytes = atoll(argv[s]);
    const int count = (int)(bytes / (long long)sizeof(float));
    float* a = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    float* b = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    for (int i = 0; i < count; ++i) a[i] = (float)((i + rank * 3) % 5 + 1);
    for (int i = 0; i < warmup; ++i) run_op(op, a, b, count, n, rank);
    for (int i = 0; i < iters; ++i) {
      const double t0 = MPI_Wtime();
      run_op(op, a, b, count, n, rank);
      times[i] = (MPI_Wtime() - t0) * 1e6;
    }
    MPI_Allreduce(MPI_IN_PLACE, times, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    qsort(times, (size_t)iters, sizeof(double), cmp_double);
    if (rank == 0) {
      printf("%lld %.3f\n", bytes, times[(iters - 1) / 2]); /* at::median's: the lower middle */
      fflush(stdout);
    }
    free(a);
    free(b);
  }
  free(times);
  MPI_Finalize();
  return 0;
}
