/* The version of the client <-> daemon shared-memory protocol. Both sides compare it
 * at connection time; any change of a wire struct or of the segment layout bumps it. */
#ifndef KD_IPC_IPC_PROTO_H
#define KD_IPC_IPC_PROTO_H

#define IPC_PROTOCOL_VERSION 1u

#endif
