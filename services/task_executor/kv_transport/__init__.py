"""The KV data plane of prefill/decode disaggregation: a prefill TE's KV goes straight to the
decode TE that continues the request, through shared memory on one host, over TCP otherwise
(NATS carries only the control messages that say who pulls what from where).

- ``outbox``: one prefill task's KV as the engine thread writes it, layer by layer;
- ``server``: the prefill side's listener, and the leases that say when its KV may be freed;
- ``session``: one puller's connection on the prefill side;
- ``client``: the decode side's ``pull`` (and ``reject``);
- ``connections``: the decode side's kept connections, one pull after another on each;
- ``pool``: the decode side's shared-memory segments, reused from pull to pull;
- ``mapped``: the prefill side's mappings of those segments, kept from pull to pull;
- ``shm``: the same-host probe and the rules for files in /dev/shm;
- ``wire``: the frames both sides exchange, and the socket I/O.
"""
