"""Engine integrations. Each subpackage adapts the plugin to one engine's internals."""
