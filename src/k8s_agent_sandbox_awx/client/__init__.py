"""The broker client: wire, core and http layers under the sync and async shells."""
