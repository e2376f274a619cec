"""Integrations of the plugin with serving engines."""
