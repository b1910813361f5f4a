"""The library every meshserve service uses: settings, bus, messages, store, logging."""
