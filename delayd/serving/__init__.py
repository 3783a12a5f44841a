"""What hosts the two servers, ``delayd serve`` (delayd.server) and ``delayd broker``
(delayd.broker): the process around them and the connections they take.

The process: ``data_dir`` (the data directory's lock, the run, the exit status),
``descriptor_limit`` (RLIMIT_NOFILE and the default connection cap), ``gc_tuning``,
``structured_logs`` (one line per record, kv or JSON), ``metrics_http`` (/metrics,
/healthz, /readyz), ``store_metrics`` (sizes and free space of the data directory),
``write_refusals`` (which logs refuse writes on a full disk).

The connections: ``listeners`` (bound before recovery, named in errors),
``stoppable_listener`` (accepting, the two-phase graceful stop), ``connection_gate``
(the cap, an accept loop that outlives EMFILE, counts), ``connection_limits``
(deadlines, cap and frame budget: the config keys), ``frame_budget``,
``connection_metrics``, ``frame_reader`` (bytes to events under those limits),
``frame_writer`` (events to bytes, in order), ``answer_queue`` (answers waiting for a
group commit), ``nowait_acquire`` (a free lock taken without a scheduling step) and
``connection`` (the skeleton both servers' connections are built on).

Nothing is re-exported here: ``descriptor_limit``, ``nowait_acquire`` and
``write_refusals`` import nothing of delayd and are used below the servers as well (the
bucket-file pools, the sender, the replayer, the broker's store), which must not load
the connection machinery with them.
"""
