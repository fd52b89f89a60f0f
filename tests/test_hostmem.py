"""hostmem on a stand-in /proc and /sys: MemTotal and MemAvailable, cgroup v2 and v1 limits (on the
process's own cgroup or a parent), NUMA nodes, how many ranks share the node, and each rank's share."""
import os

import pytest

from ckpt_offload.sizing import hostmem

GiB = 2**30
TOTAL, AVAILABLE = 64 * GiB, 40 * GiB


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A stand-in tree: meminfo with TOTAL and AVAILABLE, an empty cgroup root, no cgroup membership,
    two NUMA nodes. Returns a helper that sets /proc/self/cgroup and writes cgroup files."""
    root = tmp_path / "sys" / "fs" / "cgroup"
    root.mkdir(parents=True)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        f"MemTotal:       {TOTAL // 1024} kB\nMemFree:        {GiB // 1024} kB\n"
        f"MemAvailable:   {AVAILABLE // 1024} kB\nBuffers:        1024 kB\n"
    )
    nodes = tmp_path / "node"
    for name in ("node0", "node1", "possible", "has_cpu"):
        (nodes / name).mkdir(parents=True)
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text("")
    monkeypatch.setattr(hostmem, "_MEMINFO", str(meminfo))
    monkeypatch.setattr(hostmem, "_CGROUP_ROOT", str(root))
    monkeypatch.setattr(hostmem, "_SELF_CGROUP", str(self_cgroup))
    monkeypatch.setattr(hostmem, "_NODES", str(nodes))
    for name in ("WORLD_SIZE", *hostmem._RANK_VARS, "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)

    class Tree:
        def member_of(self, text):
            self_cgroup.write_text(text)

        def cgroup_file(self, relative, value):
            _write(str(root / relative), f"{value}\n")

        meminfo_path = meminfo

    return Tree()


def test_meminfo_and_numa(fake):
    assert hostmem.memory_total_bytes() == TOTAL
    assert hostmem.memory_available_bytes() == AVAILABLE  # no cgroup: the kernel's MemAvailable
    assert hostmem.cgroup_limit_bytes() is None
    assert hostmem.numa_nodes() == 2  # node0, node1; not possible/has_cpu


def test_unreadable_files_give_none(fake, monkeypatch):
    monkeypatch.setattr(hostmem, "_MEMINFO", str(fake.meminfo_path) + ".missing")
    monkeypatch.setattr(hostmem, "_NODES", str(fake.meminfo_path) + ".missing")
    assert hostmem.memory_total_bytes() is None
    assert hostmem.memory_available_bytes() is None
    assert hostmem.numa_nodes() is None
    assert hostmem.host_share_bytes() is None


def test_cgroup_v2_limit_binds_when_it_leaves_less(fake):
    fake.member_of("0::/job.slice/rank\n")
    fake.cgroup_file("job.slice/rank/memory.max", 16 * GiB)
    fake.cgroup_file("job.slice/rank/memory.current", 6 * GiB)
    assert hostmem.cgroup_limit_bytes() == 16 * GiB
    assert hostmem.memory_available_bytes() == 10 * GiB  # limit - current < MemAvailable
    # A limit that leaves more than the machine has available: MemAvailable binds.
    fake.cgroup_file("job.slice/rank/memory.current", 1 * GiB)
    fake.cgroup_file("job.slice/rank/memory.max", 60 * GiB)
    assert hostmem.memory_available_bytes() == AVAILABLE


def test_cgroup_v2_max_is_no_limit(fake):
    fake.member_of("0::/job.slice/rank\n")
    fake.cgroup_file("job.slice/rank/memory.max", "max")
    fake.cgroup_file("job.slice/rank/memory.current", 6 * GiB)
    assert hostmem.cgroup_limit_bytes() is None
    assert hostmem.memory_available_bytes() == AVAILABLE


def test_cgroup_v2_limit_on_a_parent(fake):
    fake.member_of("0::/job.slice/rank\n")
    fake.cgroup_file("job.slice/rank/memory.max", "max")
    fake.cgroup_file("job.slice/rank/memory.current", 2 * GiB)
    fake.cgroup_file("job.slice/memory.max", 8 * GiB)
    fake.cgroup_file("job.slice/memory.current", 5 * GiB)  # the parent counts its other children too
    assert hostmem.cgroup_limit_bytes() == 8 * GiB
    assert hostmem.memory_available_bytes() == 3 * GiB
    # A tighter limit on the child's own cgroup wins over the parent's.
    fake.cgroup_file("job.slice/rank/memory.max", 4 * GiB)
    assert hostmem.cgroup_limit_bytes() == 4 * GiB
    assert hostmem.memory_available_bytes() == 2 * GiB


def test_cgroup_v2_under_unified_on_a_hybrid_machine(fake):
    fake.member_of("4:memory:/other\n0::/job\n")
    fake.cgroup_file("unified/job/memory.max", 12 * GiB)
    fake.cgroup_file("unified/job/memory.current", 2 * GiB)
    assert hostmem.cgroup_limit_bytes() == 12 * GiB
    assert hostmem.memory_available_bytes() == 10 * GiB


def test_cgroup_v1_limit_and_its_no_limit_number(fake):
    fake.member_of("12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n")
    fake.cgroup_file("memory/docker/abc/memory.limit_in_bytes", 20 * GiB)
    fake.cgroup_file("memory/docker/abc/memory.usage_in_bytes", 15 * GiB)
    assert hostmem.cgroup_limit_bytes() == 20 * GiB
    assert hostmem.memory_available_bytes() == 5 * GiB
    # v1 writes a page-rounded 2**63 - 1 for "no limit": at or above the machine's memory is none.
    fake.cgroup_file("memory/docker/abc/memory.limit_in_bytes", 9223372036854771712)
    assert hostmem.cgroup_limit_bytes() is None
    assert hostmem.memory_available_bytes() == AVAILABLE


def test_usage_above_the_limit_leaves_zero(fake):
    fake.member_of("0::/job\n")
    fake.cgroup_file("job/memory.max", 4 * GiB)
    fake.cgroup_file("job/memory.current", 4 * GiB + 4096)
    assert hostmem.memory_available_bytes() == 0
    assert hostmem.host_share_bytes() == 0


def test_a_cgroups_inactive_page_cache_counts_as_free(fake):
    # Page cache counts in a cgroup's usage, but the kernel drops its inactive file pages before it
    # refuses memory: a job that read its dataset is not out of memory for that.
    fake.member_of("0::/job\n")
    fake.cgroup_file("job/memory.max", 16 * GiB)
    fake.cgroup_file("job/memory.current", 15 * GiB)
    fake.cgroup_file("job/memory.stat", f"anon {4 * GiB}\nfile {11 * GiB}\nactive_file {GiB}\ninactive_file {10 * GiB}")
    assert hostmem.memory_available_bytes() == 11 * GiB  # 16 - (15 - 10)
    fake.member_of("5:memory:/docker/abc\n")  # v1: the hierarchy's total_ figure
    fake.cgroup_file("memory/docker/abc/memory.limit_in_bytes", 20 * GiB)
    fake.cgroup_file("memory/docker/abc/memory.usage_in_bytes", 18 * GiB)
    fake.cgroup_file("memory/docker/abc/memory.stat", f"inactive_file {GiB}\ntotal_inactive_file {6 * GiB}")
    assert hostmem.memory_available_bytes() == 8 * GiB  # 20 - (18 - 6)


def test_the_pools_node_guard_reads_what_hostmem_reads(fake):
    import ckpt_offload

    pool = ckpt_offload.HostPool(pinned=False)
    assert pool.node_available() == -1  # a pool of one's own: unguarded until asked
    assert ckpt_offload.engine.guard_node(pool) == 3435973836  # 5% of 64 GiB
    assert pool.node_available() == AVAILABLE
    fake.member_of("0::/job\n")
    fake.cgroup_file("job/memory.max", 16 * GiB)
    fake.cgroup_file("job/memory.current", 15 * GiB)
    fake.cgroup_file("job/memory.stat", f"anon {4 * GiB}\ninactive_file {10 * GiB}\nactive_file {GiB}")
    assert ckpt_offload.engine.guard_node(pool) == GiB  # 5% of the cgroup's 16 GiB is below the 1 GiB floor
    assert pool.node_available() == hostmem.memory_available_bytes() == 11 * GiB
    fake.cgroup_file("job/memory.current", 16 * GiB + 4096)  # read again at each look, never cached
    fake.cgroup_file("job/memory.stat", "inactive_file 0")
    assert pool.node_available() == hostmem.memory_available_bytes() == 0


def test_local_world_size_from_the_launchers(fake, monkeypatch):
    """PITFALLS 37: ranks per node read from each launcher's variable. Fails where only one launcher's
    variable is read."""
    monkeypatch.setenv("WORLD_SIZE", "16")  # every node's ranks: never the divisor
    assert hostmem.local_world_size() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")  # DeepSpeed's launcher, some MPI launchers
    assert hostmem.local_world_size() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun, accelerate: first
    assert hostmem.local_world_size() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")  # set but empty: as unset
    assert hostmem.local_world_size() == 4


@pytest.mark.parametrize("env, ranks", [
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8),  # srun --ntasks-per-node=8
    ({"SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}, 8),  # srun -N2 -n16
    ({"SLURM_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "0"}, 4),  # an uneven job: each node its own count
    ({"SLURM_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "1"}, 2),
    ({"SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}, 4),
    ({"SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, 2),  # the job step's own
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 8),  # Open MPI's mpirun
    ({"MPI_LOCALNRANKS": "8"}, 8),  # MPICH's / Intel MPI's mpiexec
    ({"SLURM_NTASKS_PER_NODE": "1", "LOCAL_WORLD_SIZE": "8"}, 8),  # srun starting torchrun: torchrun's ranks
])
def test_local_world_size_under_srun_and_mpi(fake, monkeypatch, env, ranks):
    """PITFALLS 37: ranks per node under srun and mpirun. Fails where every rank plans for the whole node."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert hostmem.local_world_size() == ranks
    # budget="auto" and set_capacity("auto") divide the node by the same count.
    assert hostmem.host_share_bytes() == AVAILABLE // 2 // ranks


@pytest.mark.parametrize("name", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                  "SLURM_NTASKS_PER_NODE"])
@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_local_world_size_refuses_nonsense(fake, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be a positive integer, got '{value}'"):
        hostmem.local_world_size()


def test_host_share_divides_the_available_memory_among_the_node_ranks(fake, monkeypatch):
    assert hostmem.host_share_bytes() == AVAILABLE // 2
    assert hostmem.host_share_bytes(1.0) == AVAILABLE
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hostmem.host_share_bytes() == AVAILABLE // 2 // 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # rounded down: the ranks never add up to more
    share = hostmem.host_share_bytes(0.25)
    assert share == (AVAILABLE // 4) // 3 and 3 * share <= AVAILABLE // 4
    # The cgroup's limit is what is divided where it leaves less.
    fake.member_of("0::/job\n")
    fake.cgroup_file("job/memory.max", 12 * GiB)
    fake.cgroup_file("job/memory.current", 0)
    assert hostmem.host_share_bytes() == 6 * GiB // 3


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, True, "0.5", None])
def test_host_share_refuses_a_fraction_outside_0_1(fake, fraction):
    with pytest.raises(ValueError, match="fraction must be a number in \\(0, 1\\]"):
        hostmem.host_share_bytes(fraction)
