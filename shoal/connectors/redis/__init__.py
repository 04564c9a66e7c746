"""The Redis / Valkey / Redis Cluster pool connector."""
