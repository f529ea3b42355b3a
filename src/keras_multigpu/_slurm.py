"""SLURM's variables, read for `keras-multigpu launch`: the node count, this node's rank,
node 0's address and every node's, from `SLURM_*` and its compact node lists."""


class LaunchError(Exception):
    """A launch that cannot start: a bad script, port or count."""


def first_host(nodelist):
    """The first host of a SLURM node list: `gpu[03-05,9],cpu1` gives `gpu03`.

    >>> first_host("gpu[03-05,9],cpu1"), first_host("node7"), first_host("a-[1,2]")
    ('gpu03', 'node7', 'a-1')
    """
    head = nodelist.strip()
    if "[" in head.split(",", 1)[0]:
        prefix, rest = head.split("[", 1)
        return prefix + rest.split("]", 1)[0].split(",")[0].split("-")[0]
    return head.split(",", 1)[0]


def hosts(nodelist):
    """Every host of a SLURM node list, in order (`scontrol show hostnames`, done here).

    >>> hosts("gpu[03-05,9],cpu1")
    ['gpu03', 'gpu04', 'gpu05', 'gpu9', 'cpu1']
    """
    found, depth, part = [], 0, ""
    for char in nodelist.strip() + ",":
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            if "[" in part:
                prefix, ranges = part.split("[", 1)
                for item in ranges.rstrip("]").split(","):
                    low, _, high = item.partition("-")
                    for number in range(int(low), int(high or low) + 1):
                        found.append(f"{prefix}{number:0{len(low)}d}")
            elif part:
                found.append(part)
            part = ""
        else:
            part += char
    return found


def from_slurm(environ):
    """`(nnodes, node_rank, master_addr, node_hosts)` from SLURM's variables, or None.

    One launcher runs per node (`srun --ntasks-per-node=1 keras-multigpu launch ...`)
    and starts that node's processes.
    """
    if "SLURM_JOB_ID" not in environ or "SLURM_NNODES" not in environ:
        return None
    nnodes = int(environ["SLURM_NNODES"])
    tasks = int(environ.get("SLURM_NTASKS", nnodes))
    if tasks != nnodes:
        raise LaunchError(
            f"SLURM started {tasks} tasks on {nnodes} node(s): run one launcher per node "
            "(srun --ntasks-per-node=1 keras-multigpu launch -n GPUS_PER_NODE script.py), "
            "which starts that node's processes."
        )
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    node_hosts = hosts(nodelist) if nodelist else None
    node_rank = int(environ.get("SLURM_NODEID", environ.get("SLURM_PROCID", 0)))
    return nnodes, node_rank, first_host(nodelist) if nodelist else None, node_hosts
