"""The host weight cache: a node pool's loaded and recently idle models' weights, resident in
host shared memory tensor by tensor, in the form the engine uses, keyed by content.

- ``fingerprint``: a checkpoint tensor's content fingerprint (xxh3-128 of its dtype, shape
  and bytes), memoised per shard file;
- ``tensor_file``: one engine tensor in a shared-memory file, written once and mapped without
  a copy (plain tensors, and oneDNN's packed weights);
- ``store``: the cache itself (lookup, publish, in-use locks, budget);
- ``eviction``: which entries leave when a new one needs room (Tangram's cost), a pure
  function over its own view;
- ``multicast``: lambda-Scale's binomial pipeline schedule.
"""
