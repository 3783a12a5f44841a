"""Groups of members on etcd (DESIGN.md, "Groups, replication and failover")."""
