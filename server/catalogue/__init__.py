"""The models one server serves: the catalogue of entries (server/catalogue/entries.py), read from the
flags, a models directory and a models file (server/catalogue/sources.py), and the pool that loads them
on demand, keeps them while they are used and unloads them when idle or when others need the room
(server/catalogue/pool.py)."""
