"""The shoal SDK: one API (async `Client`, blocking `SyncClient`) over pluggable transports."""
