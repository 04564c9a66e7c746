"""The built-in filesystem KV pool ("fs"): connector, file format, admin tools."""
