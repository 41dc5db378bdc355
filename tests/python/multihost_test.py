"""The PyTorch backend across two hosts with init_method=tcp:// and no MASTER_ADDR: each rank
must publish an address its peers on the other host can reach (not 127.0.0.1).

Run once per rank by tests/harness/two_hosts.sh, which makes the two hosts (network namespaces)
and sets RANK, WORLD_SIZE and TDIST_TEST_HOST_A (host A's address, where rank 0 serves the store).
"""

import datetime
import os
import sys


def main():
    import torch
    import torch.distributed as dist
    import tdist_c10d  # noqa: F401  (registers the "tdist" backend)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    init = "tcp://%s:29572" % os.environ["TDIST_TEST_HOST_A"]
    dist.init_process_group("tdist", init_method=init, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=20))
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    want = world_size * (world_size + 1) / 2
    print("rank %d of %d via %s: all_reduce %s (expected %s)" % (rank, world_size, init,
                                                                  t[0].item(), want))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if bool((t == want).all()) else 1


if __name__ == "__main__":
    sys.exit(main())
