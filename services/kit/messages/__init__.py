"""What services exchange, written once for both sides: rollouts on the ROLLOUTS stream, a
run's errors, the trainer's epochs, the packer's reports, micro-batch tensor names and the
tensor codecs.
"""
