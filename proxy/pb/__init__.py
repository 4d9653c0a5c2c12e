"""Modules generated from proto/ (see proto/README.md); do not edit by hand."""
