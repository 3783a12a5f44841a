"""What hosts the two servers, ``delayd serve`` (delayd.server) and ``delayd broker``
(delayd.broker): the process around them and the connections they take.

The process: ``data_dir`` (the data directory's lock, the run, the exit status, the
descriptor limit raised), ``gc_tuning``, ``metrics_http`` (/metrics, /healthz,
/readyz), ``store_metrics`` (sizes and free space of the data directory).

The connections: ``listeners`` (bound before recovery, named in errors),
``stoppable_listener`` (accepting, the two-phase graceful stop), ``connection_gate``
(the cap, an accept loop that outlives EMFILE, counts), ``connection_limits``
(deadlines, the default cap the descriptor limit allows, frame budget: the config
keys), ``frame_budget``, ``connection_metrics``, ``frame_reader`` (bytes to events
under those limits), ``frame_writer`` (events to bytes, in order), ``answer_queue``
(answers waiting for a group commit) and ``connection`` (the skeleton both servers'
connections are built on).

What the layers below the servers use as well lives below them: the descriptor limit
(storage.descriptor_limit), the logs refusing writes on a full disk
(delayd.write_refusals), a free lock taken without a scheduling step
(delayd.nowait_acquire) and the log line format (delayd.structured_logs).
Nothing is re-exported here.
"""
