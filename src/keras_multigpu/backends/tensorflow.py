"""The tensorflow engine is not built yet: every entry point says so clearly."""

from keras_multigpu.backends._unsupported import unsupported

configure_cpu_devices = unsupported("tensorflow", "configure_cpu_devices", quiet=True)
list_devices = unsupported("tensorflow", "list_devices")
make_distribution = unsupported("tensorflow", "make_distribution")
replicate = unsupported("tensorflow", "replicate")
resident = unsupported("tensorflow", "resident")
shard = unsupported("tensorflow", "shard")
free_memory = unsupported("tensorflow", "free_memory")
tag = unsupported("tensorflow", "tag")
untag = unsupported("tensorflow", "untag")
process_index = unsupported("tensorflow", "process_index")
process_count = unsupported("tensorflow", "process_count")
