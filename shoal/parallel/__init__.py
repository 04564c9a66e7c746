"""Several ranks: the process group (comm), rank processes (rank) and the local fleet."""
