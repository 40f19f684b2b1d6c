/* What a mixture-of-experts layer may add to Qwen3-MoE's and Mixtral's (gpt-oss's options,
 * forerun/model/moe.py's FusedMoE): moe_block.c reads it, NULL meaning none of them; the
 * decoder stack passes NULL (it refuses gpt-oss). cpu_kernels.MoeOpts is the same layout. */
#ifndef FORERUN_MOE_OPTS_H
#define FORERUN_MOE_OPTS_H
#include <stdint.h>

typedef struct {
    const float *router_bias;   /* [E] added to the router's logits, or NULL */
    int64_t softmax_over_top_k; /* the top k logits, then the softmax over those alone */
    const void *b13, *b2;       /* expert biases in the activations' type: [E, 2I], [E, H] */
    float swiglu_alpha;         /* swiglu_limit > 0: the clamped SwiGLU (moe.clamped_swiglu) */
    float swiglu_limit;
} moe_opts_t;

#endif
