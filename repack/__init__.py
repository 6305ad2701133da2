"""The ``repack`` command line: inspect, synth, convert-hf, calibrate, split, join, verify."""
