/* tokenleap kernels: the K-quants' groups functions (Q4_K, Q5_K, Q6_K; with VNNI and without) in a
 * translation unit of their own, so that build.py compiles them on one core while the variant's
 * source (kernels.c or kernels_avx2.c, with TLQ_UNIT 1) compiles on the other: about half the
 * wall time of one unit. The same code as in one unit (quant.h, TLQ_UNIT). */
#define TLQ_UNIT 2
#include "quant.h"
