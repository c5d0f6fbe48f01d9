"""Moving tokens between ranks: where every row goes (on the device), dispatch and combine."""
