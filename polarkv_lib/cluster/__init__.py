"""A PolarKV cluster on one machine: "VMs" as network namespaces on a bridge.

Each VM is a network namespace with one veth link to a bridge, its own address and, for
every process started in it, its own hostname (UTS namespace), so `transport="auto"`
picks tcp between VMs exactly as between real hosts. Each link is capped in both
directions with tc (htb) to play a cloud NIC. Inside run the manager shard(s), one
`polarkv --role slab --role disk` per memory VM, and whatever tools or tests are run in
the client VMs.

    netns.py    namespaces, veth pairs, the bridge, tc caps, interface counters
    procs.py    starting and stopping processes inside a VM
    spec.py     the cluster's shape: VMs, addresses, the settings of each process
    harness.py  `Cluster`: up / down / status, the state file under ./.cluster/NAME/
    cli.py      `polarkv cluster up|down|status|exec`

Everything the harness creates is named with the cluster's prefix and recorded in the
state file before it is created, so `down` (or the next `up`, after a crash) removes
it all. No traffic ever leaves these namespaces and the bridge.
"""
