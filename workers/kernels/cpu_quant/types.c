/* The type table: geometry of every ggml block type the library knows, and its
 * decoder. Decoders are weak references (see decode.h): one not linked in is
 * NULL, and the type is refused instead of computed. */
#include <stddef.h>

#include "decode.h"

#if defined(__GNUC__)
#pragma weak pq_decode_q4_0
#pragma weak pq_decode_q4_1
#pragma weak pq_decode_q5_0
#pragma weak pq_decode_q5_1
#pragma weak pq_decode_q8_0
#pragma weak pq_decode_q2_k
#pragma weak pq_decode_q3_k
#pragma weak pq_decode_q4_k
#pragma weak pq_decode_q5_k
#pragma weak pq_decode_q6_k
#pragma weak pq_decode_iq4_nl
#pragma weak pq_decode_iq4_xs
#endif

static const pq_type_info TYPES[] = {
    {PQ_Q4_0, "Q4_0", 32, 18, 0, pq_decode_q4_0},
    {PQ_Q4_1, "Q4_1", 32, 20, 1, pq_decode_q4_1},
    {PQ_Q5_0, "Q5_0", 32, 22, 0, pq_decode_q5_0},
    {PQ_Q5_1, "Q5_1", 32, 24, 1, pq_decode_q5_1},
    {PQ_Q8_0, "Q8_0", 32, 34, 0, pq_decode_q8_0},
    {PQ_Q2_K, "Q2_K", PQ_QK_K, 84, 1, pq_decode_q2_k},
    {PQ_Q3_K, "Q3_K", PQ_QK_K, 110, 0, pq_decode_q3_k},
    {PQ_Q4_K, "Q4_K", PQ_QK_K, 144, 1, pq_decode_q4_k},
    {PQ_Q5_K, "Q5_K", PQ_QK_K, 176, 1, pq_decode_q5_k},
    {PQ_Q6_K, "Q6_K", PQ_QK_K, 210, 0, pq_decode_q6_k},
    {PQ_IQ4_NL, "IQ4_NL", 32, 18, 0, pq_decode_iq4_nl},
    {PQ_IQ4_XS, "IQ4_XS", PQ_QK_K, 136, 0, pq_decode_iq4_xs},
};

const pq_type_info *pq_type(int id) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].id == id) return &TYPES[i];
    return NULL;
}
