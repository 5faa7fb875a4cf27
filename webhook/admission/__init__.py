"""The admission server: AdmissionReviews over HTTPS in, JSONPatches, warnings and denials out."""
